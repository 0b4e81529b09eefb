"""The live-switch registry (issue #37): every field of every config dataclass → how the suite
knows it is live.

``(TEST, "tests/<file>.py::<test>")``: that test flips the field (from its default, or between
values) and asserts a change in what the trainer, an engine, the evaluation or the launcher does,
through the component the config is handed to. ``(VALIDATED, reason)``: the suite checks the
value only (or cannot run what it switches); the reason says which and why.

Names are the fields' dotted config paths: the training job's (``NGRPOConfig``: ``grpo.tis_cap``,
``data.train.limit`` for the fields of each source), then ``eval.`` for the evaluation CLI's own
fields (``EvalConfig``; its ``model``, ``rollout``, ``mixing``, ``reward``, ``sampling`` and
``template`` sections are the training job's classes, listed once under their training names) and
``launch.cluster.`` for the launcher's cluster options (``launch.executors.Cluster``).
tests/test_live_switches.py walks the dataclasses and fails on a field without an entry here, an
entry without a field, or a test that does not exist.
"""

from __future__ import annotations

TEST, VALIDATED = "test", "validated_only"

LIVE = "tests/test_live_switches.py::"
MISMATCH = LIVE + "test_mismatch_corrections_act_through_the_trainer"
BATCHES = LIVE + "test_batch_arithmetic_and_rollout_switches"
OPTIM = LIVE + "test_optimizer_and_schedule_switches"
LAYOUT = LIVE + "test_model_layout_switches"
OBJECTIVE = LIVE + "test_objective_switches"
DRA = LIVE + "test_dra_switches"
OUTPUTS = LIVE + "test_outputs_reference_and_starts"
ORDER = LIVE + "test_prompt_order_and_epoch_switches"
VALIDATION = LIVE + "test_validation_and_evaluation_switches"
WARMSTART = LIVE + "test_warm_start_switches"
GRADERS = "tests/test_rewards.py::test_grading_fields_reach_the_graders"
DATA = "tests/test_data.py::test_dedup_bad_rows_cache_and_split_switches"
VLLM_OPTIONS = "tests/test_vllm_engine.py::test_engine_options_reach_vllm"
CLUSTER = "tests/test_launchers.py::test_cluster_options_reach_the_script"
GOLDEN = "tests/test_launchers.py::test_golden_sbatch"
ENGINE = "tests/test_megatron_engine.py::"
REMOTE = "tests/test_remote_engine.py::"
REAL_EVAL = (
    "tests/test_real_model_train.py::test_eval_cli_scores_the_run_and_hf_export_generates_the_same"
)


def _t(test: str) -> tuple[str, str]:
    return (TEST, test)


def _v(reason: str) -> tuple[str, str]:
    return (VALIDATED, reason)


SWITCHES: dict[str, tuple[str, str]] = {
    # ---- model ----------------------------------------------------------------------------------
    "model.hf_path": _t("tests/test_real_model.py::test_logits_match_transformers"),
    "model.tensor_parallel": _t(LAYOUT),
    "model.pipeline_parallel": _t(LAYOUT),
    "model.virtual_pipeline": _t(ENGINE + "test_virtual_pipeline"),
    "model.make_vocab_size_divisible_by": _t(LAYOUT),  # the tiny config's 8: 31 rows → 32
    "model.num_real_tokens": _t(BATCHES),
    "model.dtype": _t(LAYOUT),
    "model.layer_spec": _t("tests/test_preflight.py::test_modules_follow_the_config"),
    # The core attention megatron builds (SDPA or unfused) and the plan's s² scores term.
    "model.attention": _t(
        "tests/test_attention.py::test_sdpa_attention_is_the_default_and_unfused_selectable"
    ),
    "model.sequence_parallel": _t(LAYOUT),
    "model.context_parallel": _v(
        "not run by this trainer: anything but 1 is refused wherever a training config is checked "
        "(job_config.check_not_run; test_gpu_options); the memory plan counts it"
    ),
    "model.recompute": _t(LAYOUT),
    "model.max_seq_len": _t(BATCHES),
    # ---- mixing -----------------------------------------------------------------------------------
    "mixing.strategy": _t(
        "tests/test_study.py::test_study_runs_arms_and_seeds_and_writes_table_and_plot"
    ),
    "mixing.rate": _t("tests/test_vllm_engine.py::test_replay_matches_engine_logprobs"),
    "mixing.k": _t("tests/test_vllm_engine.py::test_requests_of_different_k_share_a_step"),
    "mixing.metric": _t("tests/test_mixing.py::test_model_with_mixes_equals_float64_tp1"),
    "mixing.neighbor_source": _t("tests/test_mixing.py::test_model_with_mixes_equals_float64_tp1"),
    "mixing.temperature": _t("tests/test_mixing.py::test_decide_for_strategy_dispatch"),
    "mixing.emit": _t(ENGINE + "test_replay_logprobs"),
    "mixing.stop_after": _t(ENGINE + "test_stop_after_thinking_gate"),
    "mixing.exclude_special": _t("tests/test_mixing.py::test_exclusion_mask_from_config"),
    "mixing.exclude_padded": _t("tests/test_mixing.py::test_exclusion_mask_from_config"),
    "mixing.exclude_ids": _t("tests/test_mixing.py::test_exclusion_mask_from_config"),
    # Both engines: the built-in one on the real model, the vLLM hook in
    # test_vllm_engine.py::test_special_anchors_stay_unmixed_in_the_hook.
    "mixing.skip_special_anchors": _t(
        "tests/test_real_model.py::test_special_anchors_stay_unmixed_in_a_real_rollout"
    ),
    "mixing.embedding_grad": _t(LIVE + "test_embedding_gradient_and_table_refresh_switches"),
    "mixing.refresh_every": _t(LIVE + "test_embedding_gradient_and_table_refresh_switches"),
    "mixing.neighbor_lookup": _t(ENGINE + "test_on_demand_neighbors_equal_table"),
    "mixing.chunk_size": _v(
        "a memory bound of the table build: every chunk size gives the same table (test_mixing "
        "compares chunked and whole builds); peak memory, what it changes, is not measured"
    ),
    "mixing.noise_scale": _t(ENGINE + "test_baseline_strategies_replay"),
    "mixing.gumbel_temperature": _t("tests/test_mixing.py::test_decide_for_strategy_dispatch"),
    "mixing.at_eval": _t("tests/test_eval.py::test_validation_at_data_parallel_scale"),
    # ---- rollout ----------------------------------------------------------------------------------
    "rollout.engine": _t("tests/test_train.py::test_colocated_vllm_trains_with_mixing_and_resumes"),
    "rollout.n": _t(BATCHES),
    "rollout.temperature": _t(BATCHES),
    "rollout.top_p": _t(BATCHES),
    "rollout.top_k": _t(BATCHES),
    "rollout.max_new_tokens": _t(BATCHES),
    "rollout.stop": _t(BATCHES),
    "rollout.separate_copy": _t(BATCHES),
    "rollout.max_batch_size": _t(BATCHES),
    "rollout.batch_invariant": _t(
        "tests/test_batch_invariant.py::test_trainer_old_logprobs_from_the_engine_are_exact"
    ),
    "rollout.vllm.tensor_parallel": _t(
        "tests/test_vllm_engine.py::test_colocated_weights_equal_the_trainers_after_every_sync"
    ),
    "rollout.vllm.dtype": _t(
        "tests/test_vllm_engine.py::test_bf16_mixed_rows_equal_the_trainers_bit_for_bit"
    ),
    # (the engine fixture's KV cache holds 256 tokens: at the default length vLLM refuses to start)
    "rollout.vllm.max_model_len": _t(
        "tests/test_train.py::test_vllm_max_model_len_defaults_to_the_models_limit"
    ),
    "rollout.vllm.gpu_memory_utilization": _t(
        "tests/test_plan.py::test_vllm_reserve_follows_gpu_memory_utilization"
    ),
    "rollout.vllm.kv_cache_memory_bytes": _t(VLLM_OPTIONS),
    "rollout.vllm.max_num_seqs": _t(VLLM_OPTIONS),
    "rollout.vllm.max_num_batched_tokens": _t(VLLM_OPTIONS),
    "rollout.vllm.enforce_eager": _v(
        "must stay true (CUDA graphs would bypass the mixing hook): anything else is refused at "
        "load (test_train config errors); the engine passes it to vLLM as is"
    ),
    "rollout.vllm.in_process": _t(
        "tests/test_vllm_engine.py::test_worker_process_engine_generates_like_in_process"
    ),
    # CUDA faked (CPU vLLM refuses sleep mode): the level reaches vllm.LLM and its sleep calls.
    "rollout.vllm.sleep_level": _t("tests/test_vllm_engine.py::test_sleep_level_reaches_vllm"),
    "rollout.vllm.weight_transfer": _t(
        "tests/test_vllm_engine.py::test_weight_transfer_route_reaches_vllm_and_the_sync"
    ),
    "rollout.vllm.sync_bucket_mb": _t("tests/test_vllm_engine.py::test_weight_sync_from_megatron"),
    "rollout.vllm.verify_weights": _t(
        "tests/test_vllm_engine.py::test_weight_sync_verify_catches_corruption"
    ),
    "rollout.vllm.quantization": _v(
        "refused wherever a training config is checked until a weight-sync round trip verifies "
        "FP8 weights (job_config.check_not_run; test_gpu_options); the memory plan counts it"
    ),
    "rollout.remote.urls": _t(REMOTE + "test_startup_errors_are_one_line"),
    "rollout.remote.url_dir": _t(REMOTE + "test_startup_errors_are_one_line"),
    "rollout.remote.num_servers": _t(REMOTE + "test_startup_errors_are_one_line"),
    "rollout.remote.start_timeout_s": _t(REMOTE + "test_startup_errors_are_one_line"),
    "rollout.remote.connect_timeout_s": _t(
        REMOTE + "test_connect_timeout_bounds_each_connection_attempt"
    ),
    "rollout.remote.request_timeout_s": _t(REMOTE + "test_request_timeout_bounds_each_call"),
    "rollout.remote.weight_transfer": _t(REMOTE + "test_startup_errors_are_one_line"),
    "rollout.remote.transfer_host": _t(
        REMOTE + "test_transfer_host_is_where_the_servers_dial_back"
    ),
    "rollout.remote.bucket_mb": _t(
        REMOTE + "test_server_killed_during_weight_transfer_is_one_line"
    ),
    "rollout.remote.verify_weights": _t(
        REMOTE + "test_verify_weights_checks_every_pushed_tensor_on_the_servers"
    ),
    "rollout.remote.secret_file": _t(
        REMOTE + "test_servers_refuse_requests_without_the_jobs_secret"
    ),
    # ---- grpo -------------------------------------------------------------------------------------
    "grpo.advantage": _t(OBJECTIVE),
    "grpo.adv_eps": _t(OBJECTIVE),
    "grpo.loss_mode": _t("tests/test_grpo.py::test_loss_and_gradients_match_float64_reference"),
    "grpo.loss_agg": _t("tests/test_grpo.py::test_loss_and_gradients_match_float64_reference"),
    "grpo.clip_low": _t("tests/test_grpo.py::test_clipped_surrogate_clip_higher_and_dual_clip"),
    "grpo.clip_high": _t("tests/test_grpo.py::test_clipped_surrogate_clip_higher_and_dual_clip"),
    "grpo.dual_clip": _t("tests/test_grpo.py::test_clipped_surrogate_clip_higher_and_dual_clip"),
    "grpo.log_ratio_clamp": _t("tests/test_grpo.py::test_log_ratio_and_k3_clamps_are_the_configs"),
    "grpo.kl_mode": _t(OBJECTIVE),
    "grpo.kl_coef": _t(OBJECTIVE),
    "grpo.kl_estimator": _t("tests/test_grpo.py::test_loss_and_gradients_match_float64_reference"),
    "grpo.kl_clamp": _t("tests/test_grpo.py::test_log_ratio_and_k3_clamps_are_the_configs"),
    "grpo.filter_zero_variance": _t(OBJECTIVE),
    "grpo.old_logprobs": _t(MISMATCH),
    "grpo.tis_cap": _t(MISMATCH),
    "grpo.mismatch.mode": _t(MISMATCH),
    "grpo.mismatch.cap": _t(MISMATCH),
    "grpo.mismatch.lower": _t(MISMATCH),
    "grpo.mismatch.upper": _t(MISMATCH),
    "grpo.mismatch.log_ratio_clamp": _t(MISMATCH),
    "grpo.dra.enabled": _t(DRA),
    "grpo.dra.embedder": _t(DRA),
    "grpo.dra.model_path": _t(
        "tests/test_dra.py::test_local_model_embedder_mean_pools_against_float64"
    ),
    "grpo.dra.max_length": _t(
        "tests/test_dra.py::test_local_model_embedder_mean_pools_against_float64"
    ),
    "grpo.dra.scope": _t(DRA),
    "grpo.dra.ngram": _t(DRA),
    "grpo.dra.hash_dim": _t(DRA),
    # ---- optim ------------------------------------------------------------------------------------
    "optim.lr": _t(OPTIM),
    "optim.min_lr": _t(OPTIM),
    "optim.lr_schedule": _t(OPTIM),
    "optim.warmup_steps": _t(OPTIM),
    "optim.weight_decay": _t(OPTIM),
    "optim.adam_beta1": _t(OPTIM),
    "optim.adam_beta2": _t(OPTIM),
    "optim.adam_eps": _t(OPTIM),
    "optim.clip_grad": _t(OPTIM),
    "optim.distributed_optimizer": _t(OPTIM),
    # ---- train ------------------------------------------------------------------------------------
    "train.run_dir": _t(OUTPUTS),
    "train.seed": _t(OBJECTIVE),
    "train.prompts_per_step": _t(BATCHES),
    "train.mini_batch_prompts": _t(BATCHES),
    "train.epochs_per_rollout": _t(BATCHES),
    "train.micro_batch_size": _t(BATCHES),
    "train.pack_sequences": _t(LIVE + "test_packed_and_budgeted_micro_batches_train_like_unpacked"),
    "train.max_tokens_per_micro_batch": _t(
        LIVE + "test_packed_and_budgeted_micro_batches_train_like_unpacked"
    ),
    "train.max_steps": _t(OPTIM),
    "train.num_epochs": _t(ORDER),
    "train.load": _t(OUTPUTS),
    "train.reference": _t(OUTPUTS),
    "train.save_every": _t(OUTPUTS),
    "train.async_save": _t("tests/test_train.py::test_sigkill_and_resume_is_bit_identical"),
    "train.keep_last": _t("tests/test_train.py::test_sigkill_and_resume_is_bit_identical"),
    "train.resume": _t(OUTPUTS),
    "train.stop.enabled": _t("tests/test_stop.py::test_switched_off_nothing_is_handled"),
    "train.stop.margin_s": _t(
        "tests/test_train.py::test_the_deadline_saves_before_it_and_a_broken_latest_falls_back"
    ),
    "train.stop.time_limit_s": _t("tests/test_stop.py::test_deadline_comes_from_the_allocation"),
    "train.log_every": _t(ORDER),
    "train.tensorboard": _t(OUTPUTS),
    "train.trackers.wandb": _t(
        "tests/test_trackers.py::test_wandb_and_mlflow_get_the_same_scalars_and_resume_the_same_run"
    ),
    "train.trackers.mlflow": _t(
        "tests/test_trackers.py::test_wandb_and_mlflow_get_the_same_scalars_and_resume_the_same_run"
    ),
    "train.trackers.project": _t(
        "tests/test_trackers.py::test_wandb_and_mlflow_get_the_same_scalars_and_resume_the_same_run"
    ),
    "train.trackers.run_name": _t(
        "tests/test_trackers.py::test_run_name_mode_and_mlflow_uri_reach_the_trackers"
    ),
    "train.trackers.wandb_mode": _t(
        "tests/test_trackers.py::test_run_name_mode_and_mlflow_uri_reach_the_trackers"
    ),
    "train.trackers.mlflow_uri": _t(
        "tests/test_trackers.py::test_run_name_mode_and_mlflow_uri_reach_the_trackers"
    ),
    "train.progress": _t(OUTPUTS),
    "train.dump_generations": _t(BATCHES),
    "train.warmstart.path": _t(WARMSTART),
    "train.warmstart.steps": _t(WARMSTART),
    "train.warmstart.batch_size": _t(WARMSTART),
    "train.warmstart.lr": _t(WARMSTART),
    "train.dist_timeout_s": _t("tests/test_train.py::test_sigkill_and_resume_is_bit_identical"),
    # The watchdog's deadlines and switch (training/watchdog.py: Deadlines, Watchdog.start).
    **{
        f"train.watchdog.{name}": _t("tests/test_watchdog.py::test_deadlines_follow_the_config")
        for name in (
            "enabled",
            "rollout_s",
            "weight_sync_s",
            "update_s",
            "save_s",
            "validation_s",
            "first_s",
            "floor_s",
            "factor",
        )
    },
    "train.async.max_staleness": _t(
        "tests/test_train.py::test_sigkill_and_resume_is_bit_identical"
    ),
    "train.async.on_stale": _t(LIVE + "test_stale_rollout_rule_reaches_the_producer"),
    "train.dynamic_sampling.enabled": _t(
        "tests/test_dynamic_sampling.py::test_refills_batches_with_informative_groups"
    ),
    "train.dynamic_sampling.max_gen_batches": _t(
        "tests/test_dynamic_sampling.py::test_exhausted_rounds_error_or_partial"
    ),
    "train.dynamic_sampling.on_exhausted": _t(
        "tests/test_dynamic_sampling.py::test_exhausted_rounds_error_or_partial"
    ),
    # ---- data (data.train.*: the fields of each source, also the evaluation's extra_benchmarks)
    "data.train": _t(ORDER),
    "data.train.name": _t("tests/test_data.py::test_train_set_filters_long_prompts"),
    "data.train.path": _t(ORDER),
    "data.train.split": _t(DATA),
    "data.train.problem_key": _t("tests/test_data.py::test_nested_keys_and_missing_fields"),
    "data.train.answer_key": _t("tests/test_data.py::test_nested_keys_and_missing_fields"),
    "data.train.answer_list": _t("tests/test_data.py::test_answer_list_reaches_the_problems"),
    "data.train.integer_answers": _t(
        "tests/test_data.py::test_every_file_loads_with_readme_row_count"
    ),
    "data.train.answer_after": _t("tests/test_data.py::test_gsm8k_sources_and_held_out_set"),
    "data.train.kind": _t("tests/test_eval.py::test_multiple_choice_benchmark"),
    "data.train.limit": _t("tests/test_data.py::test_train_set_filters_long_prompts"),
    "data.max_prompt_tokens": _t("tests/test_data.py::test_train_set_filters_long_prompts"),
    "data.dedup": _t(DATA),
    "data.decontaminate": _t(
        "tests/test_data.py::test_decontaminate_drops_the_named_benchmarks_only"
    ),
    "data.max_bad_fraction": _t(DATA),
    "data.long_prompts": _t(
        "tests/test_data.py::test_ungradable_math_answer_and_long_prompt_refused"
    ),
    "data.template.kind": _t("tests/test_data.py::test_templates"),
    "data.template.think": _t("tests/test_data.py::test_templates"),
    "data.template.instruction": _t(
        "tests/test_eval.py::test_instruction_none_is_the_default_and_empty_is_none_for_every_kind"
    ),
    "data.shuffle": _t(ORDER),
    "data.seed": _t(ORDER),
    "data.cache_dir": _t(DATA),
    # ---- reward -----------------------------------------------------------------------------------
    "reward.name": _t("tests/test_rewards.py::test_reward_function_from_config"),
    "reward.timeout_s": _t(GRADERS),
    "reward.memory_mb": _t(GRADERS),
    "reward.workers": _t(GRADERS),
    "reward.max_response_chars": _t(GRADERS),
    "reward.fallback": _t(GRADERS),
    "reward.free_text": _t(GRADERS),
    "reward.box_rule": _t(GRADERS),
    "reward.mcq_mode": _t(GRADERS),
    "reward.mcq_letters": _t(GRADERS),
    "reward.format_weight": _t("tests/test_rewards.py::test_reward_function_from_config"),
    "reward.format_think_close": _t(GRADERS),
    "reward.overlong": _t("tests/test_rewards.py::test_reward_function_from_config"),
    "reward.overlong_buffer": _t("tests/test_rewards.py::test_reward_function_from_config"),
    "reward.overlong_weight": _t(GRADERS),
    "reward.max_response_tokens": _t("tests/test_rewards.py::test_reward_function_from_config"),
    # ---- validation (validation.sampling.*: also the evaluation CLI's sampling) -------------------
    "validation.every": _t(VALIDATION),
    "validation.at_start": _t(
        "tests/test_study.py::test_study_runs_arms_and_seeds_and_writes_table_and_plot"
    ),
    "validation.benchmarks": _t(VALIDATION),
    "validation.limit": _t(VALIDATION),
    "validation.sampling.n": _t(VALIDATION),
    "validation.sampling.temperature": _t(VALIDATION),
    "validation.sampling.top_p": _t(VALIDATION),
    "validation.sampling.top_k": _t(VALIDATION),
    "validation.sampling.max_new_tokens": _t(VALIDATION),
    "validation.sampling.seed": _t(VALIDATION),
    "validation.keep_best": _t(VALIDATION),
    "validation.max_tokens_per_call": _t(VALIDATION),
    "tokenizer": _t("tests/test_train.py::test_model_folder_tokenizer_is_the_default"),
    # ---- the evaluation CLI -----------------------------------------------------------------------
    "eval.benchmarks": _t(REAL_EVAL),
    "eval.extra_benchmarks": _t(VALIDATION),
    "eval.limit": _t(VALIDATION),
    "eval.tokenizer": _t(VALIDATION),
    "eval.model": _t(VALIDATION),  # the eval CLI on the tiny model (regrade needs none)
    # (the tiny task's model folder has no weights: the CLI evaluates the run's checkpoint; the real
    # model's two training steps leave its greedy text as it was, so REAL_EVAL cannot see it)
    "eval.checkpoint": _t(VALIDATION),
    "eval.ks": _t("tests/test_eval.py::test_regrade_and_cli"),
    "eval.max_tokens_per_call": _t(VALIDATION),
    "eval.dist_timeout_s": _t(REAL_EVAL),
    "eval.output_dir": _t("tests/test_eval.py::test_regrade_and_cli"),
    "eval.regrade": _t("tests/test_eval.py::test_regrade_and_cli"),
    # ---- the launcher's cluster options -------------------------------------------------------------
    "launch.cluster.account": _t(GOLDEN),
    "launch.cluster.partition": _t(GOLDEN),
    "launch.cluster.time": _t(CLUSTER),
    "launch.cluster.container_image": _t(GOLDEN),
    "launch.cluster.container_mounts": _t(GOLDEN),
    "launch.cluster.env": _t(GOLDEN),
    "launch.cluster.passthrough": _t(
        "tests/test_env_passthrough.py::test_passed_through_value_is_in_no_script_and_no_file"
    ),
    # (the local executor runs the checkout in place whatever the field: a Slurm script shows it)
    "launch.cluster.packager": _t(CLUSTER),
    "launch.cluster.rdzv_port": _t(CLUSTER),
    "launch.cluster.exclusive": _t(CLUSTER),
    "launch.cluster.mem": _t(CLUSTER),
    "launch.cluster.group_start_wait": _t(CLUSTER),
    "launch.cluster.group_monitor_wait": _t(CLUSTER),
    "launch.cluster.signal_lead_s": _t(
        "tests/test_chain.py::test_until_done_and_signal_lead_reach_the_script"
    ),
}
