"""Disaggregated N-GRPO training of DeepSeek-R1-Distill-Qwen-14B on Slurm: recipe r1-14b as one
heterogeneous job, 4-8 training nodes + a group of vLLM rollout server nodes.

Copy this file, set the variables below, and run it from the repository root:
    python launchers/r1_14b_disaggregated.py --dryrun    # print the sbatch script(s), submit nothing
    python launchers/r1_14b_disaggregated.py [a.b=c ...] # submit and follow the job
More `ngrpo-launch run` options and config overrides may follow; they win. The layout
(TP/PP/SP, GPUs, vLLM engines) is the recipe's: `ngrpo-launch recipes`, docs/LAUNCHING.md.
"""

import sys

from megatron_ngrpo.launch import script

# ---- site settings: edit these ----------------------------------------------------------------
ACCOUNT = "my-account"
PARTITION = "gpu"
# pyxis/enroot image (launchers/image/ builds one); None: the nodes' own Python environment.
CONTAINER_IMAGE = None
MOUNTS = []  # "SRC:DST" container mounts; the model folder and the configs are added
ENV = {}  # e.g. {"NCCL_SOCKET_IFNAME": "ib0"}
MODELS_DIR = "/models"  # holds DeepSeek-R1-Distill-Qwen-14B/
NODES = 4
ROLLOUT_NODES = 2  # nodes of vLLM rollout servers (the trainer sends them weights over NCCL)
OVERRIDES = ["train.run_dir=/lustre/ngrpo/runs/r1-14b"]  # run_dir: absolute, seen by every node


def main(argv: list[str]) -> int:
    return script.slurm(
        "r1-14b",
        account=ACCOUNT,
        partition=PARTITION,
        container_image=CONTAINER_IMAGE,
        mounts=MOUNTS,
        env=ENV,
        models_dir=MODELS_DIR,
        nodes=NODES,
        overrides=OVERRIDES,
        disaggregated=True,
        rollout_nodes=ROLLOUT_NODES,
        argv=argv,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
