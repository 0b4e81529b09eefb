"""Launch recipes: the one table of models, parallel layouts and vLLM settings, and the commands
(training, evaluation, conversion) they render.

Every number a launch depends on lives in :data:`RECIPES`; :mod:`megatron_ngrpo.launch.memory` turns a recipe
into the expected GPU memory per rank (``ngrpo-launch memory``, docs/LAUNCHING.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import yaml
from omegaconf import OmegaConf

from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.launch import memory
from megatron_ngrpo.models.config import ModelConfig
from megatron_ngrpo.models.provider import check_layout
from megatron_ngrpo.rollout.config import EngineName
from megatron_ngrpo.rollout.remote.passthrough import refused_argument

# Entry points, run as ``python -m`` of the installed (or packaged) package, never as checkout paths.
TRAIN_MODULE = "megatron_ngrpo.train"
EVAL_MODULE = "megatron_ngrpo.eval"
CONVERT_MODULE = "megatron_ngrpo.conversion"  # hf-to-megatron | megatron-to-hf (= ngrpo-convert)
# The rollout servers of a disaggregated job (vLLM with N-GRPO's mixing hook) listen on
# consecutive ports from here, one per engine on a node, and register their URLs in a folder of
# the job directory (NeMo-Run maps /nemo_run to it, inside containers and out).
ROLLOUT_SERVER = "megatron_ngrpo.rollout.remote.server"
ROLLOUT_PORT = 8000
ROLLOUT_URL_DIR = "/nemo_run/rollout_servers"
# A rollout-only GPU holds nothing but its vLLM engine: its KV cache takes what the node has
# (the colocated recipes' 0.35-0.4 would leave ~2.7x less KV cache there).
ROLLOUT_NODE_GPU_MEMORY_UTILIZATION = 0.9

TASKS = ("train", "eval", "convert-hf", "convert-megatron")


@dataclass(frozen=True)
class ModelShape:
    """The config.json facts of a Qwen2 checkpoint that building and sizing it depend on (the
    published values, so that a plan needs no hub access)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_positions: int = 131072

    def hf_config(self) -> dict:
        return dict(
            architectures=["Qwen2ForCausalLM"],
            model_type="qwen2",
            num_hidden_layers=self.layers,
            hidden_size=self.hidden,
            intermediate_size=self.ffn,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            vocab_size=self.vocab,
            tie_word_embeddings=self.tied,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_positions,
            hidden_act="silu",
            torch_dtype="bfloat16",
        )

    def spec(self) -> ArchSpec:
        return ArchSpec.from_dict(self.hf_config(), source="megatron_ngrpo.launch.recipes")


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    # Directory name of the Hugging Face checkpoint under --models-dir.
    hf_name: str
    shape: ModelShape
    nodes: int
    min_nodes: int
    max_nodes: int
    # Ranks per node (= GPUs per node on GPU; gpus_per_node 0 = CPU ranks).
    procs_per_node: int
    gpus_per_node: int
    tensor_parallel: int
    pipeline_parallel: int
    sequence_parallel: bool
    recompute: bool
    # Longest sequence: max prompt + max response (4096 + 8192); vLLM's max_model_len.
    seq_len: int
    rollout_engine: EngineName
    vllm_tensor_parallel: int
    vllm_gpu_memory_utilization: float
    time: str
    # Nodes of the rollout group of a disaggregated (heterogeneous) job.
    rollout_nodes: int = 1
    # The training config this layout is made for (relative to the code root; `ngrpo-launch plan`).
    config: str | None = None
    # Tokens of one training micro-batch: its train.max_tokens_per_micro_batch (0: one sequence).
    micro_batch_tokens: int = 0

    @cached_property
    def spec(self) -> ArchSpec:
        return self.shape.spec()

    def world_size(self, nodes: int) -> int:
        return nodes * self.procs_per_node

    def data_parallel(self, nodes: int) -> int:
        return self.world_size(nodes) // (self.tensor_parallel * self.pipeline_parallel)

    def validate(self, nodes: int) -> None:
        """One-line errors for layouts this recipe cannot take on ``nodes`` nodes."""
        if not self.min_nodes <= nodes <= self.max_nodes:
            raise ConfigError(
                f"recipe {self.name}: nodes = {nodes}: expected {self.min_nodes}..{self.max_nodes}"
            )
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if self.world_size(nodes) % model_parallel:
            raise ConfigError(
                f"recipe {self.name}: {self.world_size(nodes)} ranks not divisible by TP×PP = {model_parallel}"
            )
        if self.procs_per_node % self.vllm_tensor_parallel:
            raise ConfigError(
                f"recipe {self.name}: vLLM TP = {self.vllm_tensor_parallel} does not divide {self.procs_per_node} ranks per node"
            )
        check_layout(
            self.spec,
            ModelConfig(
                tensor_parallel=self.tensor_parallel, pipeline_parallel=self.pipeline_parallel
            ),
        )

    def train_layout(self, nodes: int | None = None) -> memory.TrainLayout:
        return memory.TrainLayout(
            tp=self.tensor_parallel,
            pp=self.pipeline_parallel,
            dp=self.data_parallel(nodes or self.nodes),
            tokens=self.micro_batch_tokens or self.seq_len,
            sequence_parallel=self.sequence_parallel and self.tensor_parallel > 1,
            recompute=self.recompute,
        )

    def train_memory(self, nodes: int | None = None) -> memory.TrainMemory:
        return memory.train_memory(self.spec, self.train_layout(nodes))

    def vllm_memory(self) -> memory.VLLMMemory:
        return memory.vllm_memory(
            self.spec, self.vllm_tensor_parallel, self.vllm_gpu_memory_utilization
        )

    def model_overrides(self, hf_path: str) -> list[str]:
        return [
            f"model.hf_path={hf_path}",
            f"model.tensor_parallel={self.tensor_parallel}",
            f"model.pipeline_parallel={self.pipeline_parallel}",
            f"model.sequence_parallel={self.sequence_parallel}",
            f"model.recompute={self.recompute}",
        ]

    def layout(self) -> dict[str, str]:
        """The config keys the recipe sets (key -> override value): this table is their one
        source; the recipe's YAML does not state them (:func:`check_configs`)."""
        overrides = (*self.model_overrides("")[1:], *self.rollout_overrides())
        return dict(o.split("=", 1) for o in overrides)

    def rollout_servers_per_node(self) -> int:
        """vLLM engines per node of the rollout group (data-parallel over the node's GPUs)."""
        if self.gpus_per_node % self.vllm_tensor_parallel:
            raise ConfigError(
                f"recipe {self.name}: vLLM TP = {self.vllm_tensor_parallel} does not divide the "
                f"rollout group's {self.gpus_per_node} GPUs per node"
            )
        return max(self.gpus_per_node // self.vllm_tensor_parallel, 1)

    def rollout_overrides(self, disaggregated: bool = False) -> list[str]:
        if disaggregated:  # the trainer finds the rollout group's servers by their registrations
            # GPU servers: weights go from global rank 0 to every server over NCCL, not as HTTP pushes
            # (base64 of the whole model per server per step, buffered by each worker).
            route = ["rollout.remote.weight_transfer=nccl"] if self.gpus_per_node else []
            return [
                "rollout.engine=remote",
                f"rollout.remote.url_dir={ROLLOUT_URL_DIR}",
                f"rollout.remote.num_servers={self.rollout_nodes * self.rollout_servers_per_node()}",
                *route,
            ]
        out = [f"rollout.engine={self.rollout_engine}"]
        if self.rollout_engine == EngineName.vllm:
            out += [
                f"rollout.vllm.tensor_parallel={self.vllm_tensor_parallel}",
                f"rollout.vllm.gpu_memory_utilization={self.vllm_gpu_memory_utilization}",
                f"rollout.vllm.max_model_len={self.seq_len}",
            ]
        return out


_H100 = dict(
    procs_per_node=8,
    gpus_per_node=8,
    sequence_parallel=True,
    recompute=True,
    seq_len=4096 + 8192,
    micro_batch_tokens=2 * (4096 + 8192),
    rollout_engine=EngineName.vllm,
)

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in [
        Recipe(
            name="r1-1.5b",
            summary="DeepSeek-R1-Distill-Qwen-1.5B, 1 node × 8 H100",
            hf_name="DeepSeek-R1-Distill-Qwen-1.5B",
            # Untied (unlike Qwen2.5-1.5B): the published card's 1.78 B parameters.
            shape=ModelShape(
                layers=28, hidden=1536, ffn=8960, heads=12, kv_heads=2, vocab=151936, tied=False
            ),
            config="configs/ngrpo_r1_1.5b.yaml",
            nodes=1,
            min_nodes=1,
            max_nodes=2,
            tensor_parallel=1,
            pipeline_parallel=1,
            vllm_tensor_parallel=1,
            vllm_gpu_memory_utilization=0.35,
            time="24:00:00",
            **_H100,
        ),
        Recipe(
            name="r1-7b",
            summary="DeepSeek-R1-Distill-Qwen-7B, 2-4 nodes × 8 H100",
            hf_name="DeepSeek-R1-Distill-Qwen-7B",
            shape=ModelShape(
                layers=28, hidden=3584, ffn=18944, heads=28, kv_heads=4, vocab=152064, tied=False
            ),
            config="configs/ngrpo_r1_7b.yaml",
            nodes=2,
            min_nodes=2,
            max_nodes=4,
            tensor_parallel=4,
            pipeline_parallel=1,
            vllm_tensor_parallel=2,
            vllm_gpu_memory_utilization=0.4,
            time="48:00:00",
            **_H100,
        ),
        Recipe(
            name="r1-14b",
            summary="DeepSeek-R1-Distill-Qwen-14B, 4-8 nodes × 8 H100",
            hf_name="DeepSeek-R1-Distill-Qwen-14B",
            shape=ModelShape(
                layers=48,
                hidden=5120,
                ffn=13824,
                heads=40,
                kv_heads=8,
                vocab=152064,
                tied=False,
                rope_theta=1e6,
                rms_norm_eps=1e-5,
            ),
            config="configs/ngrpo_r1_14b.yaml",
            nodes=4,
            min_nodes=4,
            max_nodes=8,
            tensor_parallel=8,
            pipeline_parallel=1,
            vllm_tensor_parallel=4,
            vllm_gpu_memory_utilization=0.4,
            time="72:00:00",
            rollout_nodes=2,
            **_H100,
        ),
        # CPU smoke runs (laptop, CI): the default shape of tests/harness/tiny.py, two gloo ranks
        # with TP 2.
        Recipe(
            name="tiny",
            summary="tiny random Qwen2 (tests.harness.tiny), CPU, 2 ranks, TP 2",
            hf_name="tiny-qwen2",
            shape=ModelShape(
                layers=4, hidden=128, ffn=256, heads=4, kv_heads=2, vocab=512, tied=False
            ),
            nodes=1,
            min_nodes=1,
            max_nodes=2,
            procs_per_node=2,
            gpus_per_node=0,
            tensor_parallel=2,
            pipeline_parallel=1,
            sequence_parallel=False,
            recompute=False,
            seq_len=256,
            rollout_engine=EngineName.megatron,
            vllm_tensor_parallel=1,
            vllm_gpu_memory_utilization=0.5,
            time="00:10:00",
        ),
    ]
}


def get(name: str) -> Recipe:
    if name not in RECIPES:
        raise ConfigError(f"recipe {name!r}: unknown (expected one of {', '.join(RECIPES)})")
    return RECIPES[name]


def check_configs(recipe: Recipe, configs, overrides=()) -> None:
    """One-line error where a config file states a key of the recipe's layout otherwise: the
    recipe's override would replace it silently. A command-line override of the key is explicit
    (it comes after the recipe's, so it wins) and lifts the check for that key."""
    explicit = {o.split("=", 1)[0] for o in overrides}
    for path in configs:
        try:
            cfg = OmegaConf.load(path)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not YAML ({str(e).splitlines()[0]})") from None
        for key, value in recipe.layout().items():
            got = OmegaConf.select(cfg, key, default=None)
            if key not in explicit and got is not None and str(got) != value:
                raise ConfigError(
                    f"{path}: {key} = {got!r}: recipe {recipe.name} sets {value} "
                    f"(megatron_ngrpo/launch/recipes.py); drop it from the file or override {key}"
                )


@dataclass(frozen=True)
class Command:
    """One process command line, started once per rank under torchrun or, with ``per_node``,
    once per node."""

    argv: tuple[str, ...]
    per_node: bool = False

    @classmethod
    def python(cls, module: str, args: tuple[str, ...]) -> Command:
        return cls(("python", "-m", module, *args))


@dataclass(frozen=True)
class TaskSpec:
    """What to run where: the command and its ranks."""

    name: str
    command: Command
    nodes: int
    procs_per_node: int
    gpus_per_node: int
    env: dict[str, str] = field(default_factory=dict)


def render(
    recipe: Recipe,
    task: str,
    *,
    hf_path: str,
    configs: tuple[str, ...] = (),
    checkpoint: str | None = None,
    output: str | None = None,
    nodes: int | None = None,
    overrides: tuple[str, ...] = (),
    module: str | None = None,
    disaggregated: bool = False,
) -> TaskSpec:
    """The command of ``task`` for ``recipe``.

    train / eval: ``python -m <module> --config FILE... <recipe overrides> <overrides>``; the
    recipe's overrides come first, so the user's win (OmegaConf applies them in order).
    ``module`` replaces the entry module (anything taking ``--config FILE [a.b=c ...]``).
    ``disaggregated``: the trainer generates on the rollout group's servers (:func:`rollout_server`).
    convert-hf / convert-megatron: ``python -m megatron_ngrpo.conversion hf-to-megatron`` /
    ``megatron-to-hf`` with the recipe's TP × PP, one rank per model-parallel rank on one node;
    ``overrides`` are extra arguments of the converter.
    """
    nodes = nodes or recipe.nodes
    recipe.validate(nodes)
    if task not in TASKS:
        raise ConfigError(f"task {task!r}: expected one of {', '.join(TASKS)}")
    if task in ("train", "eval"):
        return _entry_task(recipe, task, hf_path, configs, nodes, overrides, module, disaggregated)
    return _conversion_task(recipe, task, hf_path, checkpoint, output, overrides)


def _entry_task(
    recipe: Recipe,
    task: str,
    hf_path: str,
    configs: tuple[str, ...],
    nodes: int,
    overrides: tuple[str, ...],
    module: str | None,
    disaggregated: bool,
) -> TaskSpec:
    """train / eval: the entry module on the configs, the recipe's overrides, then the user's."""
    if not configs:
        raise ConfigError(f"task {task}: --config FILE.yaml is required")
    for o in overrides:
        if "=" not in o or o.startswith("-"):
            raise ConfigError(f"override {o!r}: expected key.sub=value")
    entry = module or (TRAIN_MODULE if task == "train" else EVAL_MODULE)
    args = (
        *(a for c in configs for a in ("--config", c)),
        *recipe.model_overrides(hf_path),
        *recipe.rollout_overrides(disaggregated),
        *overrides,
    )
    return TaskSpec(
        task, Command.python(entry, args), nodes, recipe.procs_per_node, recipe.gpus_per_node
    )


def _conversion_task(
    recipe: Recipe,
    task: str,
    hf_path: str,
    checkpoint: str | None,
    output: str | None,
    overrides: tuple[str, ...],
) -> TaskSpec:
    """convert-hf / convert-megatron: the converter at the recipe's TP x PP on one node."""
    if not output:
        raise ConfigError(f"task {task}: --output DIR is required")
    layout = ("--tp", str(recipe.tensor_parallel), "--pp", str(recipe.pipeline_parallel))
    if task == "convert-hf":
        args = ("hf-to-megatron", "--input", hf_path, "--output", output, *layout, *overrides)
    else:
        if not checkpoint:
            raise ConfigError("task convert-megatron: --checkpoint DIR is required")
        args = (
            "megatron-to-hf",
            "--input",
            checkpoint,
            "--output",
            output,
            "--hf-source",
            hf_path,
            *layout,
            *overrides,
        )
    model_parallel = recipe.tensor_parallel * recipe.pipeline_parallel
    return TaskSpec(
        task,
        Command.python(CONVERT_MODULE, args),
        1,
        model_parallel,
        min(recipe.gpus_per_node, model_parallel),
    )


def rollout_server(recipe: Recipe, hf_path: str, extra: tuple[str, ...] = ()) -> TaskSpec:
    """The rollout group of a disaggregated job: on every node, one rollout server process
    (vLLM with N-GRPO's mixing hook, :mod:`megatron_ngrpo.rollout.remote.server`) running one engine of
    vLLM TP per block of the node's GPUs; ``extra``: more server options (those a server refuses,
    rollout/remote/passthrough.py, raise ConfigError)."""
    if problem := refused_argument(extra):
        raise ConfigError(f"--rollout-args: {problem}")
    argv = (
        "python",
        "-m",
        ROLLOUT_SERVER,
        "--model",
        hf_path,
        "--port",
        str(ROLLOUT_PORT),
        "--tensor-parallel-size",
        str(recipe.vllm_tensor_parallel),
        "--data-parallel-size",
        str(recipe.rollout_servers_per_node()),
        "--gpu-memory-utilization",
        str(
            ROLLOUT_NODE_GPU_MEMORY_UTILIZATION
            if recipe.gpus_per_node
            else recipe.vllm_gpu_memory_utilization
        ),
        "--max-model-len",
        str(recipe.seq_len),
        "--url-dir",
        ROLLOUT_URL_DIR,
        *extra,
    )
    return TaskSpec(
        "rollout", Command(argv, per_node=True), recipe.rollout_nodes, 1, recipe.gpus_per_node
    )
