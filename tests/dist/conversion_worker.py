"""Multi-process conversion cases (run by tests/test_conversion.py under one 4-process torchrun).

Tiny HF models live in ``$NGRPO_CONV_DIR`` (written by the pytest fixture). Every case compares
against the HF files themselves (tensor equality) and against HF transformers logits (fp32).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from tests.harness.forward import megatron_logits
from tests.harness.multiproc import case, run_cases

ROOT = Path(os.environ.get("NGRPO_CONV_DIR", "/tmp/ngrpo_conv"))
MODELS = ("qwen2", "llama", "qwen3", "qwen2_tied", "llama_tied")
# (tp, pp, vpp) on 4 ranks; TP4 > 2 KV heads exercises megatron's KV-head replication path.
LAYOUTS = ((1, 1, None), (2, 1, None), (4, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2))
TOKENS = torch.tensor(
    [[3, 17, 250, 9, 299, 42, 7, 100, 64, 2], [5, 5, 200, 1, 0, 33, 128, 280, 12, 99]]
)
_HF_LOGITS: dict[str, torch.Tensor] = {}


def hf_dir(name: str) -> Path:
    return ROOT / name


def hf_logits(name: str) -> torch.Tensor:
    """HF transformers fp32 logits of TOKENS (cached per process)."""
    if name not in _HF_LOGITS:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf_dir(name), dtype=torch.float32)
        with torch.no_grad():
            _HF_LOGITS[name] = model(TOKENS).logits.float()
    return _HF_LOGITS[name]


def model_cfg(name: str, tp: int, pp: int, vpp: int | None, **kw):
    from megatron_ngrpo.models.config import ModelConfig

    return ModelConfig(
        hf_path=str(hf_dir(name)),
        tensor_parallel=tp,
        pipeline_parallel=pp,
        virtual_pipeline=vpp,
        dtype="float32",
        layer_spec="local",
        **kw,
    )


def use_layout(tp: int, pp: int, vpp: int | None = None) -> None:
    """Switch megatron's parallel state to (tp, pp, vpp) unless it is there already."""
    from megatron_ngrpo.conversion.convert import current_layout
    from megatron_ngrpo.parallel import initialize_model_parallel

    if current_layout() != (tp, pp, vpp):
        initialize_model_parallel(tp, pp, vpp, seed=1234)


def build(name: str, tp: int, pp: int, vpp: int | None = None, **kw):
    from megatron_ngrpo.models.provider import build_model

    use_layout(tp, pp, vpp)
    cfg = model_cfg(name, tp, pp, vpp, **kw)
    return build_model(cfg, init_weights=False), cfg  # every parameter is loaded next


def check_logits(chunks, name: str, tol: float = 1e-5) -> float:
    """Max |Megatron − HF| over real vocab columns (on last-stage ranks; 0 elsewhere)."""
    from megatron_ngrpo.architecture import ArchSpec

    logits = megatron_logits(chunks, TOKENS)
    if logits is None:
        return 0.0
    vocab = ArchSpec.from_hf(hf_dir(name)).vocab_size
    err = (logits[..., :vocab] - hf_logits(name)).abs().max().item()
    assert err < tol, f"{name}: logits differ from HF by {err}"
    assert (logits[..., vocab:] == 0).all(), "padded vocab rows must give zero logits"
    return err


def check_export(chunks, name: str, rank0_only: bool) -> int:
    """export_hf_tensors equals the HF files exactly, in HF's order of layers; returns count."""
    from megatron_ngrpo.architecture import ArchSpec
    from megatron_ngrpo.conversion.hf_export import export_hf_tensors
    from megatron_ngrpo.conversion.hf_io import HFCheckpoint
    from megatron_ngrpo.conversion.mapping import hf_layout

    spec = ArchSpec.from_hf(hf_dir(name))
    ref = HFCheckpoint(hf_dir(name))
    got = {}
    for hf_name, t in export_hf_tensors(chunks, spec, rank0_only=rank0_only):
        assert hf_name not in got, f"{hf_name} exported twice"
        got[hf_name] = t
    receives = not rank0_only or dist.get_rank() == 0
    if not receives:
        assert not got, "only rank 0 receives in rank0_only mode"
        return 0
    layers = [int(n.split(".")[2]) for n in got if n.startswith("model.layers.")]
    assert layers == sorted(layers), "export is not in layer order"
    assert set(got) == set(hf_layout(spec)), set(got) ^ set(hf_layout(spec))
    bad = [n for n in got if not torch.equal(got[n], ref[n])]
    assert not bad, f"exported tensors differ: {bad}"
    return len(got)


def check_tp_shard_export(chunks, name: str) -> int:
    """export_hf_tensors(tp_shards=TPShard(count, j)): every TP-split tensor is slice j of count
    of the HF tensor (rows, or columns for o_proj / down_proj), the others the full tensor, for
    count = TP and TP/2 and two assignments of slices to ranks each (a rank's own slice, and
    slices that must be sent or merged from other ranks); refused in one line where the layout
    cannot be cut (PP > 1, KV heads not divisible by TP)."""
    from megatron.core import parallel_state as ps

    from megatron_ngrpo.architecture import ArchSpec
    from megatron_ngrpo.conversion.hf_export import TPShard, check_tp_shards, export_hf_tensors
    from megatron_ngrpo.conversion.hf_io import HFCheckpoint

    spec = ArchSpec.from_hf(hf_dir(name))
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    why = check_tp_shards(spec, tp, ps.get_pipeline_model_parallel_world_size())
    if why:
        try:
            list(export_hf_tensors(chunks, spec, tp_shards=TPShard(tp, rank)))
        except ValueError as e:
            assert why in str(e), e
            return 0
        raise AssertionError(f"tp_shards export at an unsplittable layout ({why}) did not raise")
    ref, cut = HFCheckpoint(hf_dir(name)), 0
    for count in sorted({c for c in (tp, tp // 2) if c > 1}):
        for j in (rank % count, (rank + 1) % count):
            for hf_name, t in export_hf_tensors(chunks, spec, tp_shards=TPShard(count, j)):
                full = ref[hf_name]
                if t.shape != full.shape:
                    dim = next(d for d in range(t.dim()) if t.shape[d] != full.shape[d])
                    full = full.chunk(count, dim=dim)[j]
                    cut += 1
                assert torch.equal(t, full), f"{name} {hf_name}: not slice {j} of {count}"
    assert (cut > 0) == (tp > 1), cut
    return cut


def _layout_case(tp: int, pp: int, vpp: int | None):
    def fn():
        from megatron_ngrpo.architecture import ArchSpec
        from megatron_ngrpo.conversion.hf_import import load_hf_tensors
        from megatron_ngrpo.conversion.hf_io import HFCheckpoint

        errors = {}
        for name in MODELS:
            chunks, _ = build(name, tp, pp, vpp)
            load_hf_tensors(chunks, ArchSpec.from_hf(hf_dir(name)), HFCheckpoint(hf_dir(name)))
            errors[name] = check_logits(chunks, name)
            check_export(chunks, name, rank0_only=False)
            check_export(chunks, name, rank0_only=True)
            check_tp_shard_export(chunks, name)
        return errors

    fn.__name__ = layout_name(tp, pp, vpp)
    return case(fn)


def layout_name(tp: int, pp: int, vpp: int | None) -> str:
    return f"mapping_tp{tp}pp{pp}" + (f"vpp{vpp}" if vpp else "")


for _layout in LAYOUTS:
    _layout_case(*_layout)


# ---------------------------------------------------------------- checkpoint files


def fresh(name: str) -> Path:
    """An absent output path, the same on every rank."""
    path = ROOT / "out" / name
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        (ROOT / "out").mkdir(exist_ok=True)
    dist.barrier()
    return path


def assert_same_hf(out: Path, ref: Path, dtype: torch.dtype | None = None) -> None:
    """HF directory ``out`` holds exactly ``ref``'s tensors (cast to ``dtype``), an index and the
    carried-over files; transformers loads it to the same logits."""
    import json

    from megatron_ngrpo.conversion.hf_io import INDEX, HFCheckpoint

    got, want = HFCheckpoint(out), HFCheckpoint(ref)
    assert set(got) == set(want), set(got) ^ set(want)
    bad = [
        n for n in want if not torch.equal(got[n], want[n] if dtype is None else want[n].to(dtype))
    ]
    assert not bad, f"{out}: tensors differ from {ref}: {bad}"
    index = json.loads((out / INDEX).read_text())
    assert set(index["weight_map"]) == set(want)
    assert (out / "generation_config.json").read_text() == (
        ref / "generation_config.json"
    ).read_text()
    assert not list(out.parent.glob(".*.partial")), "temporary directory left behind"
    if dtype is None and dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        with torch.no_grad():
            logits = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(TOKENS).logits
        assert torch.equal(logits, hf_logits(ref.name)), "reloaded HF model gives other logits"


def _roundtrip_case(name: str, tp: int, pp: int, vpp: int | None = None):
    def fn():
        from megatron_ngrpo.conversion.checkpoint import load_megatron_checkpoint
        from megatron_ngrpo.conversion.convert import (
            convert_hf_to_megatron,
            convert_megatron_to_hf,
        )

        mdir, hdir = fresh(f"{fn.__name__}_m"), fresh(f"{fn.__name__}_hf")
        use_layout(tp, pp, vpp)
        convert_hf_to_megatron(hf_dir(name), mdir, tp=tp, pp=pp, vpp=vpp, progress=False)
        chunks, _ = build(name, tp, pp, vpp)
        meta, _ = load_megatron_checkpoint(chunks, mdir)
        assert (meta["tensor_parallel"], meta["pipeline_parallel"]) == (tp, pp)
        err = check_logits(chunks, name)
        convert_megatron_to_hf(mdir, hdir, tp=tp, pp=pp, vpp=vpp, progress=False)
        assert_same_hf(hdir, hf_dir(name))
        return err

    fn.__name__ = f"roundtrip_{name}_tp{tp}pp{pp}" + (f"vpp{vpp}" if vpp else "")
    return case(fn)


_roundtrip_case("qwen2", 2, 2)
_roundtrip_case("llama", 2, 1)
_roundtrip_case("qwen3", 1, 2)
_roundtrip_case("qwen2_tied", 1, 1)
_roundtrip_case("llama_tied", 1, 2, 2)


@case
def reshard_padded_vocab():
    """Qwen3 (vocab 300: padded 512 at TP2, 384 at TP1) TP2×PP2 → TP1 → PP2×VPP2 → TP2×PP2:
    logits at every layout and the final export equal the HF source."""
    from megatron_ngrpo.conversion.checkpoint import load_megatron_checkpoint, read_meta
    from megatron_ngrpo.conversion.convert import (
        convert_hf_to_megatron,
        convert_megatron_to_hf,
    )

    name = "qwen3"
    steps = [(2, 2, None), (1, 1, None), (1, 2, 2), (2, 2, None)]
    prev = hf_dir(name)
    padded = []
    for i, (tp, pp, vpp) in enumerate(steps):
        out = fresh(f"reshard_{i}")
        use_layout(tp, pp, vpp)
        convert_hf_to_megatron(prev, out, tp=tp, pp=pp, vpp=vpp, progress=False)
        padded.append(read_meta(out)["padded_vocab_size"])
        chunks, _ = build(name, tp, pp, vpp)
        load_megatron_checkpoint(chunks, out)
        check_logits(chunks, name)
        prev = out
    assert padded == [512, 384, 384, 512], padded
    hdir = fresh("reshard_hf")
    use_layout(2, 2)
    convert_megatron_to_hf(prev, hdir, tp=2, pp=2, progress=False)
    assert_same_hf(hdir, hf_dir(name))
    return padded


@case
def reshard_tied_pp():
    """Tied Qwen2 TP2×PP2 (output layer on the last stage shares the embedding key) → TP1 → TP4."""
    from megatron_ngrpo.conversion.convert import (
        convert_hf_to_megatron,
        convert_megatron_to_hf,
    )

    name, prev = "qwen2_tied", hf_dir("qwen2_tied")
    for i, (tp, pp) in enumerate([(2, 2), (1, 1), (4, 1)]):
        out = fresh(f"reshard_tied_{i}")
        use_layout(tp, pp)
        convert_hf_to_megatron(prev, out, tp=tp, pp=pp, progress=False)
        prev = out
    hdir = fresh("reshard_tied_hf")
    use_layout(4, 1)
    convert_megatron_to_hf(prev, hdir, tp=4, pp=1, progress=False)
    assert_same_hf(hdir, hf_dir(name))


@case
def run_directory_latest_and_dtypes():
    """A trainer run directory (iter_*/ + latest) converts to HF; bf16 and fp16 outputs equal
    the fp32 source cast; a bf16 Megatron checkpoint round-trips bf16 tensors exactly."""
    from megatron_ngrpo.conversion.checkpoint import (
        checkpoint_meta,
        load_megatron_checkpoint,
        save_megatron_checkpoint,
        write_latest,
    )
    from megatron_ngrpo.conversion.convert import (
        convert_hf_to_megatron,
        convert_megatron_to_hf,
    )
    from megatron_ngrpo.conversion.hf_io import load_hf_into_megatron

    name = "llama"
    run = fresh("run")
    chunks, cfg = build(name, 2, 2)
    load_hf_into_megatron(chunks, hf_dir(name))
    for step in (5, 10):
        save_megatron_checkpoint(chunks, run / f"iter_{step:07d}", checkpoint_meta(cfg, step=step))
        if dist.get_rank() == 0:
            write_latest(run, f"iter_{step:07d}")
        dist.barrier()
    chunks, _ = build(name, 1, 1)
    meta, _ = load_megatron_checkpoint(chunks, run)
    assert meta["step"] == 10
    check_logits(chunks, name)
    for dtype in (torch.bfloat16, torch.float16):
        out = fresh(f"run_hf_{dtype}")
        convert_megatron_to_hf(run, out, dtype=str(dtype).removeprefix("torch."), progress=False)
        assert_same_hf(out, hf_dir(name), dtype)
    m16 = fresh("bf16_m")
    use_layout(1, 2)
    convert_hf_to_megatron(hf_dir(name), m16, tp=1, pp=2, dtype="bfloat16", progress=False)
    back = fresh("bf16_hf")
    convert_megatron_to_hf(m16, back, tp=1, pp=2, progress=False)
    assert_same_hf(back, hf_dir(name), torch.bfloat16)


# ---------------------------------------------------------------- bad input


def _write_truncated_hf(
    src: Path, dst: Path, drop: tuple[str, ...] = (), reshape: dict | None = None
) -> None:
    from safetensors.torch import save_file

    from megatron_ngrpo.conversion.hf_io import HFCheckpoint

    if dist.get_rank() == 0:
        dst.mkdir(parents=True)
        shutil.copy(src / "config.json", dst / "config.json")
        ref = HFCheckpoint(src)
        tensors = {n: ref[n] for n in ref if n not in drop}
        tensors.update(reshape or {})
        save_file(tensors, str(dst / "model.safetensors"))
    dist.barrier()


def _raises(fn, *needles: str) -> str:
    from megatron_ngrpo.conversion.mapping import ConversionError

    try:
        fn()
    except ConversionError as e:
        msg = str(e)
        assert "\n" not in msg, f"multi-line error: {msg}"
        missing = [n for n in needles if n not in msg]
        assert not missing, f"error does not name {missing}: {msg}"
        return msg
    raise AssertionError("no ConversionError raised")


@case
def errors_truncated_or_mismatched():
    """Bad HF or Megatron inputs: one error naming every missing / wrong tensor; no output."""
    from megatron_ngrpo.conversion.checkpoint import load_megatron_checkpoint
    from megatron_ngrpo.conversion.convert import (
        convert_hf_to_megatron,
        convert_megatron_to_hf,
    )

    src = hf_dir("qwen2")
    trunc = fresh("trunc_hf")
    _write_truncated_hf(
        src,
        trunc,
        drop=("model.layers.3.mlp.down_proj.weight", "lm_head.weight"),
        reshape={
            "model.layers.1.self_attn.k_proj.weight": torch.zeros(32, 128),
            "model.layers.9.mlp.up_proj.weight": torch.zeros(2),
        },
    )
    out = fresh("trunc_m")
    use_layout(2, 2)
    msgs = [
        _raises(
            lambda: convert_hf_to_megatron(trunc, out, tp=2, pp=2, progress=False),
            "model.layers.3.mlp.down_proj.weight",
            "lm_head.weight",
            "model.layers.1.self_attn.k_proj.weight (32, 128) (expected (64, 128))",
            "model.layers.9.mlp.up_proj.weight",
        )
    ]
    assert not out.exists() and not list(out.parent.glob(".trunc_m*")), "partial output written"

    # Megatron checkpoint of the tied model loaded as the untied one: no output layer.
    tied = fresh("tied_m")
    convert_hf_to_megatron(hf_dir("qwen2_tied"), tied, tp=2, pp=2, progress=False)
    chunks, _ = build("qwen2", 2, 2)
    msgs.append(
        _raises(lambda: load_megatron_checkpoint(chunks, tied), "missing", "output_layer.weight")
    )
    # A checkpoint whose config.json no longer matches its tensors: wrong shapes, no HF output.
    import json

    if dist.get_rank() == 0:
        cfg = json.loads((tied / "config.json").read_text())
        cfg["intermediate_size"] = 128
        (tied / "config.json").write_text(json.dumps(cfg))
    dist.barrier()
    hout = fresh("mismatch_hf")
    msgs.append(
        _raises(
            lambda: convert_megatron_to_hf(tied, hout, tp=2, pp=2, progress=False),
            "decoder.layers.mlp.linear_fc1.weight",
            "decoder.layers.mlp.linear_fc2.weight",
        )
    )
    assert not hout.exists() and not list(hout.parent.glob(".mismatch_hf*")), (
        "partial output written"
    )
    return msgs


if __name__ == "__main__":
    run_cases()
