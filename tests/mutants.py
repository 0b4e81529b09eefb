"""Mutants of live switches (issue #45 item 2): every live entry of tests/live_switches.py
carries the generic mutant :class:`Ignored` (the option is ignored: its field is built at its
dataclass default wherever the dataclass is instantiated), and some carry hand-written source
patches (:class:`Mutant`) that switch the option off where the generic one cannot reach, or wire
it wrongly; each mutant's test must then fail.

A :class:`Mutant` replaces ``old`` (exactly one occurrence) by ``new`` in ``file`` of a copy of
the tree. A mutant's test is the entry's registry test unless it names another (an implementation
detail the trainer-level test cannot see, killed by the unit test that reads it, e.g. the
normaliser of a mismatch correction). ``fast``: its test runs within about a minute on a loaded
2-core machine (a generic mutant: its test is in ``FAST``). CI's rotating sample draws generic
mutants of ``FAST`` tests. scripts/mutants.py applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.live_switches import SWITCHES, TEST


@dataclass(frozen=True)
class Mutant:
    file: str
    old: str
    new: str
    test: str = ""  # default: the entry's registry test
    fast: bool = False


@dataclass(frozen=True)
class Ignored:
    """The generic mutant: the entry's field ignored (tests/support/ignored_field/sitecustomize.py
    in the root of the copy). A test that flips the field and checks the outcome kills it."""

    test: str = ""  # default: the entry's registry test
    fast: bool = False


# Registry tests whose generic mutants CI's rotating sample draws from: unit tests in one process,
# about 20-30 s a run (a fresh interpreter, torch and megatron imports, the test) on an idle 2-core
# machine.
FAST = {
    "tests/test_grpo.py::test_clipped_surrogate_clip_higher_and_dual_clip",
    "tests/test_grpo.py::test_log_ratio_and_k3_clamps_are_the_configs",
    "tests/test_mixing.py::test_exclusion_mask_from_config",
}


ENGINE = "megatron_ngrpo/rollout/megatron_engine.py"
HOOK = "megatron_ngrpo/rollout/vllm/hook.py"

MUTANTS: dict[str, list[Mutant]] = {
    # ---- mixing ---------------------------------------------------------------------------------
    "mixing.emit": [
        Mutant(ENGINE, 'if mixing.emit == "anchor":  # a step', "if True:  # a step"),
        Mutant(
            HOOK,
            'emit_anchor = opts["emit"] == "anchor"',
            "emit_anchor = True",
            test="tests/test_vllm_engine.py::test_replay_matches_engine_logprobs[0.3-sample-1.0]",
        ),
    ],
    "mixing.neighbor_lookup": [
        Mutant(
            "megatron_ngrpo/mixing/neighbor_mode.py",
            "    return mixing.lookup_mode(positions, vocab_size, device_type)",
            '    return "table" if mixing.neighbor_lookup == "auto" else '
            "mixing.lookup_mode(positions, vocab_size, device_type)",
            test="tests/test_neighbor_source.py::test_lookup_resolves_once_per_run",
            fast=True,
        ),
    ],
    "mixing.skip_special_anchors": [
        Mutant(
            "megatron_ngrpo/mixing/perturbations.py",
            "if special is not None and cfg.skip_special_anchors:",
            "if False:",
        ),
        Mutant(
            "megatron_ngrpo/mixing/perturbations.py",
            "if special is not None and cfg.skip_special_anchors:",
            "if False:",
            test="tests/test_mixing.py::test_special_anchors_stay_unmixed_in_every_strategy",
            fast=True,
        ),
        Mutant(
            HOOK,
            "keep = dec.mixed.tolist() if r0.decision.skip_special_anchors else ()",
            "keep = ()",
            test="tests/test_vllm_engine.py::test_special_anchors_stay_unmixed_in_the_hook",
        ),
    ],
    # ---- grpo -----------------------------------------------------------------------------------
    "grpo.mismatch.mode": [
        Mutant("megatron_ngrpo/training/loss_stage.py", 'if corr.mode != "off":', "if False:"),
        Mutant(
            "megatron_ngrpo/grpo/update.py",
            "kept = batch.mask if inputs.keep is None else batch.mask & inputs.keep",
            "kept = batch.mask",
            test="tests/test_mismatch.py::test_rejected_tokens_leave_the_trainers_sum_and_normaliser",
            fast=True,
        ),
    ],
    "grpo.tis_cap": [
        Mutant(
            "megatron_ngrpo/grpo/config.py",
            "        if self.tis_cap is not None:\n",
            "        if False:\n",
        ),
        Mutant(
            "megatron_ngrpo/grpo/config.py",
            "        if self.tis_cap is not None:\n",
            "        if False:\n",
            test="tests/test_mismatch.py::test_tis_cap_is_token_tis",
            fast=True,
        ),
    ],
    # ---- training -------------------------------------------------------------------------------
    "train.async_save": [
        Mutant(
            "megatron_ngrpo/training/trainer.py", "if t.async_save:", "if False and t.async_save:"
        ),
    ],
    "train.pack_sequences": [
        Mutant(
            "megatron_ngrpo/grpo/packing.py",
            "    if not pack_sequences:\n",
            "    if True:\n",
        ),
    ],
    "train.dynamic_sampling.enabled": [
        Mutant(
            "megatron_ngrpo/training/rollout_stage.py",
            "if fewest >= need or len(rounds) == ds.max_gen_batches:",
            "if True:",
        ),
    ],
    # ---- rollout and launch ---------------------------------------------------------------------
    "rollout.vllm.sleep_level": [
        Mutant(
            "megatron_ngrpo/rollout/vllm/engine.py",
            "self.llm.sleep(level=self.cfg.sleep_level)",
            "self.llm.sleep(level=1)",
            fast=True,
        ),
    ],
    "launch.cluster.group_start_wait": [
        Mutant(
            "megatron_ngrpo/launch/executors.py",
            "wait_time_for_group_job=cluster.group_start_wait,",
            "wait_time_for_group_job=cluster.group_monitor_wait,",
            fast=True,
        ),
    ],
    "launch.cluster.mem": [
        Mutant(
            "megatron_ngrpo/launch/executors.py",
            'mem=cluster.mem if cluster.mem is not None else ("0" if gpu else None),',
            'mem="0" if gpu else None,',
            fast=True,
        ),
    ],
}


def mutants_of(name: str) -> list[Mutant | Ignored]:
    """A live entry's mutants: the generic one, then its hand-written ones."""
    if SWITCHES[name][0] != TEST:
        return []
    return [Ignored(fast=SWITCHES[name][1] in FAST), *MUTANTS.get(name, [])]
