"""The quick tier (`bash tools/test.sh --quick`): which tests are marked `slow` (tests/conftest.py).

Written by tools/mark_slow.py from a measured run of the whole suite; do not edit SLOW by hand,
measure again. QUICK_DISTRIBUTED is chosen: one distributed test per parallel family, always in
the quick tier.
"""

MEASURED = '2026-11-28'  # on x86_64, 2 cores, Python 3.11.7
BUDGET_S = 135  # measured seconds of the quick tier's tests, at most

QUICK_DISTRIBUTED = [
    'tests/distributed/test_model_parallel.py::test_tensor_parallel_2_matches_reference',
    'tests/distributed/test_model_parallel.py::test_pipeline_parallel_2_schedule_matches_reference',
    'tests/distributed/test_model_parallel.py::test_context_parallel_2_padded_and_packed_match_reference',
    'tests/distributed/test_step_parallel.py::test_layout_matches_single_process[dp2]',
    'tests/distributed/test_routing_replay.py::test_replay_parallel_layout_matches_single_process[pp2_vpp2_ep2]',
]

SLOW = [  # measured seconds
    'tests/distributed/test_async_runs.py::test_async_recipe_trains_on_most_tokens',  # 10.7
    'tests/distributed/test_async_runs.py::test_exit_interval_then_resume_repeats_the_uninterrupted_run',  # 6.4
    'tests/distributed/test_async_runs.py::test_launch_without_trainer_ranks_is_refused',  # 6.9
    'tests/distributed/test_async_runs.py::test_resume_after_sigkill_repeats_the_uninterrupted_run[rollout_rank]',  # 6.2
    'tests/distributed/test_async_runs.py::test_resume_after_sigkill_repeats_the_uninterrupted_run[trainer_rank0]',  # 7.4
    'tests/distributed/test_async_runs.py::test_separate_rollout_rank_repeats_the_colocated_policy_lag',  # 15.3
    'tests/distributed/test_async_runs.py::test_tp2_trainer_with_two_rollout_ranks_repeats_the_colocated_run',  # 12.7
    'tests/distributed/test_checkpoint_memory.py::test_the_dp_sharded_save_does_not_hold_the_whole_optimizer_state',  # 3.2
    'tests/distributed/test_checkpoint_reshard.py::test_asynchronous_save_is_the_state_at_save_time',  # 7.5
    'tests/distributed/test_checkpoint_reshard.py::test_checkpoint_files_and_marker',  # 10.0
    'tests/distributed/test_checkpoint_reshard.py::test_plain_adam_reshards_and_is_refused_by_the_distributed_optimizer',  # 3.2
    'tests/distributed/test_checkpoint_reshard.py::test_resume_on_another_layout_continues_the_run[tp2dp2]',  # 3.2
    'tests/distributed/test_correction_parallel.py::test_compiled_equals_eager_with_groups',  # 16.2
    'tests/distributed/test_correction_parallel.py::test_sharded_equals_single_process[2]',  # 2.9
    'tests/distributed/test_correction_parallel.py::test_sharded_equals_single_process[4]',  # 3.5
    'tests/distributed/test_correction_parallel.py::test_sharded_equals_single_process[8]',  # 10.7
    'tests/distributed/test_dumps.py::test_analyze_reads_a_tiny_cpu_run_and_reproduces_the_trainers_metrics',  # 10.5
    'tests/distributed/test_dumps.py::test_dumps_hold_the_step_batch_the_same_under_every_layout',  # 11.4
    'tests/distributed/test_eval_run.py::test_greedy_eval_is_transformers_greedy_and_metrics_match_generations',  # 29.0
    'tests/distributed/test_harness.py::test_a_ddp_models_groups_and_threads_do_not_outlive_the_case',  # 2.9
    'tests/distributed/test_harness.py::test_a_hang_fails_within_the_collective_timeout',  # 8.8
    'tests/distributed/test_harness.py::test_an_exception_is_reraised_with_its_rank_and_traceback',  # 3.8
    'tests/distributed/test_hf_moe_parallel.py::test_log_probs_and_logits_match_transformers[qwen3_moe-ep2]',  # 19.3
    'tests/distributed/test_hf_moe_parallel.py::test_log_probs_and_logits_match_transformers[qwen3_moe-pp2]',  # 10.7
    'tests/distributed/test_hf_moe_parallel.py::test_log_probs_and_logits_match_transformers[qwen3_moe-tp2]',  # 8.8
    'tests/distributed/test_hf_parallel.py::test_log_probs_match_transformers[qwen2-pp2]',  # 3.7
    'tests/distributed/test_hf_parallel.py::test_log_probs_match_transformers[qwen2-tp1]',  # 6.6
    'tests/distributed/test_hf_parallel.py::test_log_probs_match_transformers[qwen2-tp2]',  # 3.2
    'tests/distributed/test_hf_runs.py::test_dataset_run_resumes_with_the_next_prompts',  # 5.5
    'tests/distributed/test_hf_runs.py::test_export_of_a_run_equals_its_save_hf',  # 19.3
    'tests/distributed/test_hf_runs.py::test_save_hf_writes_a_checkpoint_transformers_loads',  # 4.6
    'tests/distributed/test_hf_runs.py::test_score_a_run_checkpoint',  # 13.3
    'tests/distributed/test_hf_runs.py::test_score_matches_transformers[tp2]',  # 17.9
    'tests/distributed/test_memory_model.py::test_ddp_is_given_the_distributed_optimizers_layout',  # 6.7
    'tests/distributed/test_memory_model.py::test_parameters_per_rank_equal_the_formula',  # 5.8
    'tests/distributed/test_memory_model.py::test_total_is_the_unpadded_single_copy_model',  # 6.4
    'tests/distributed/test_moe_parallel.py::test_alltoall_with_expert_tensor_parallelism_is_refused_on_gloo',  # 28.7
    'tests/distributed/test_moe_parallel.py::test_expert_checkpoint_reshards_between_expert_layouts',  # 29.1
    'tests/distributed/test_moe_parallel.py::test_expert_layouts_train_like_one_process',  # 21.7
    'tests/distributed/test_moe_runs.py::test_expert_parallel_run_follows_ep1_and_resumes_exactly',  # 17.9
    'tests/distributed/test_rollout_world.py::test_one_process_dp2_tp2_pp2_and_cp2_sample_identical_rollouts',  # 3.3
    'tests/distributed/test_rollout_world.py::test_rollout_groups_of_two_ranks_spread_and_return_the_samples',  # 3.3
    'tests/distributed/test_routing_replay.py::test_replay_parallel_layout_matches_single_process[tp2sp_cp2_packed]',  # 2.8
    'tests/distributed/test_routing_replay.py::test_trainer_replays_the_engines_routing',  # 3.0
    'tests/distributed/test_step_parallel.py::test_layout_matches_single_process[cp2]',  # 3.8
    'tests/distributed/test_step_parallel.py::test_layout_matches_single_process[cp2pp2]',  # 3.1
    'tests/distributed/test_step_parallel.py::test_layout_matches_single_process[cp4]',  # 4.2
    'tests/distributed/test_step_parallel.py::test_layout_matches_single_process[pp2]',  # 3.0
    'tests/distributed/test_step_parallel.py::test_layout_matches_single_process[tp2cp2]',  # 4.2
    'tests/distributed/test_step_parallel.py::test_layout_matches_single_process[tp2cp2pp2]',  # 4.9
    'tests/distributed/test_step_parallel.py::test_layout_matches_single_process[tp2pp2]',  # 3.3
    'tests/distributed/test_step_parallel.py::test_optimizer_settings_match_single_process[tp2cp2_overlap_grads]',  # 3.2
    'tests/distributed/test_step_parallel.py::test_recompute_matches_single_process[tp2_full_uniform]',  # 2.8
    'tests/distributed/test_step_parallel.py::test_single_process_micro_batch_size_independent',  # 3.6
    'tests/distributed/test_trackers_run.py::test_trackers_log_what_metrics_jsonl_holds_and_a_resume_continues_their_runs',  # 6.5
    'tests/distributed/test_trainer.py::test_a_dp2_run_resumes_on_tp2_and_on_pp2',  # 4.1
    'tests/distributed/test_trainer.py::test_every_preset_recipe_trains',  # 9.3
    'tests/distributed/test_trainer.py::test_extending_a_finished_run_continues_it',  # 4.6
    'tests/distributed/test_trainer.py::test_kl_and_the_step_correction_under_pp_and_cp[layout0]',  # 5.9
    'tests/distributed/test_trainer.py::test_kl_and_the_step_correction_under_pp_and_cp[layout1]',  # 4.8
    'tests/distributed/test_trainer.py::test_resumed_run_repeats_the_uninterrupted_one',  # 4.5
    'tests/distributed/test_trainer.py::test_torchrun_end_to_end_writes_finite_metrics',  # 22.0
    'tests/distributed/test_trainer.py::test_tp_pp_cp_replicas_train_on_identical_rollouts',  # 4.9
    'tests/distributed/test_validation.py::test_a_resumed_run_validates_like_the_uninterrupted_one',  # 18.0
    'tests/distributed/test_validation.py::test_eval_of_a_checkpoint_repeats_the_runs_validation_at_its_step',  # 3.0
    'tests/distributed/test_validation.py::test_the_run_validates_before_training_every_test_freq_steps_and_at_the_last',  # 14.3
    'tests/distributed/test_validation.py::test_validation_is_the_same_under_every_layout',  # 12.5
    'tests/distributed/test_weight_stream.py::test_stream_equals_the_export_in_small_buckets[1-2]',  # 7.9
    'tests/distributed/test_weight_stream.py::test_stream_equals_the_export_in_small_buckets[2-1]',  # 7.8
    'tests/unit/test_ablate.py::test_end_to_end_two_settings_one_seed',  # 29.9
    'tests/unit/test_ablate.py::test_write_report_from_synthetic_metrics',  # 2.3
    'tests/unit/test_analyze.py::test_plots_are_drawn_and_readable',  # 4.3
    'tests/unit/test_analyze.py::test_scored_file_summary_has_the_contract_and_the_correction_numbers',  # 3.2
    'tests/unit/test_bench_correction.py::test_table_with_the_compiled_call',  # 10.0
    'tests/unit/test_checkpoint.py::test_the_asynchronous_writer_is_megatrons_own_on_every_version',  # 3.9
    'tests/unit/test_console.py::test_a_real_run_prints_none_of_the_known_warnings',  # 17.1
    'tests/unit/test_console.py::test_entry_points_import_megatron_core_only_inside_the_process_groups',  # 5.9
    'tests/unit/test_context.py::test_padded_split_equals_megatron_get_batch_on_this_cp_rank[2]',  # 2.7
    'tests/unit/test_correction_compiled.py::test_compiled_equals_eager[dapo-packed]',  # 4.9
    'tests/unit/test_correction_compiled.py::test_compiled_equals_eager[dapo-padded]',  # 5.6
    'tests/unit/test_correction_compiled.py::test_compiled_equals_eager[seq_is-packed]',  # 4.5
    'tests/unit/test_correction_compiled.py::test_compiled_equals_eager[seq_is-padded]',  # 4.2
    'tests/unit/test_correction_compiled.py::test_compiled_equals_eager[token_is-packed]',  # 5.3
    'tests/unit/test_correction_compiled.py::test_compiled_equals_eager[token_is-padded]',  # 4.2
    'tests/unit/test_docs.py::test_docs_command_runs[README.md:megatron-rlcorr analyze runs/tiny_cpu --out runs/tiny_cpu/analysis]',  # 4.4
    'tests/unit/test_docs.py::test_docs_command_runs[docs/configuration.md:python tools/config_reference.py --check]',  # 3.1
    'tests/unit/test_docs.py::test_docs_command_runs[docs/scaling.md:GPUS_PER_NODE=8 bash tools/launch.sh recipes/dapo_qwen2.5_7b_rollout_corr.yaml --dry-run]',  # 3.2
    'tests/unit/test_docs.py::test_docs_command_runs[docs/scaling.md:NNODES=16 GPUS_PER_NODE=8 NODE_RANK=0 MA.../dapo_qwen2.5_32b_rollout_corr.yaml --dry-run0]',  # 2.8
    'tests/unit/test_docs.py::test_docs_command_runs[docs/scaling.md:NNODES=16 GPUS_PER_NODE=8 NODE_RANK=0 MA.../dapo_qwen2.5_32b_rollout_corr.yaml --dry-run1]',  # 3.2
    'tests/unit/test_docs.py::test_docs_command_runs[docs/scaling.md:srun --nodes=16 --ntasks-per-node=1 bash...sh recipes/dapo_qwen2.5_32b_rollout_corr.yaml0]',  # 3.0
    'tests/unit/test_docs.py::test_docs_command_runs[docs/scaling.md:srun --nodes=16 --ntasks-per-node=1 bash...sh recipes/dapo_qwen2.5_32b_rollout_corr.yaml1]',  # 2.9
    'tests/unit/test_docs.py::test_docs_command_runs[docs/troubleshooting.md:megatron-rlcorr analyze runs/my_run --out analysis]',  # 2.9
    'tests/unit/test_docs.py::test_docs_command_runs[docs/troubleshooting.md:megatron-rlcorr analyze runs/my_run/dump....rollout_correction.rollout_rs_threshold=1.02]',  # 2.9
    'tests/unit/test_docs.py::test_docs_command_runs[docs/troubleshooting.md:megatron-rlcorr analyze runs/tiny_cpu --out runs/tiny_cpu/analysis]',  # 3.0
    'tests/unit/test_docs.py::test_docs_command_runs[docs/troubleshooting.md:megatron-rlcorr analyze scored.jsonl --out analysis]',  # 3.8
    'tests/unit/test_examples.py::test_correction_api_example_runs',  # 2.8
    'tests/unit/test_import_verl.py::test_the_importer_does_not_import_megatron',  # 3.1
    'tests/unit/test_launch.py::test_dry_run_one_process_without_gpus',  # 3.0
    'tests/unit/test_launch.py::test_dry_run_under_slurm',  # 3.1
    'tests/unit/test_launch.py::test_dry_run_with_explicit_topology',  # 2.9
    'tests/unit/test_launch.py::test_recipe_checked_for_the_launch_world_and_roles_printed',  # 14.6
    'tests/unit/test_launch.py::test_relative_recipe_from_another_directory',  # 3.3
    'tests/unit/test_launch.py::test_slurm_fallbacks_and_user_values_first',  # 6.1
    'tests/unit/test_launch.py::test_two_process_cpu_run',  # 15.8
    'tests/unit/test_launch.py::test_vllm_sleep_mode_refuses_expandable_segments',  # 12.3
    'tests/unit/test_make_tiny_hf.py::test_force_rewrites_the_same_bytes',  # 7.0
    'tests/unit/test_make_tiny_hf.py::test_moe_config_and_weights',  # 8.8
    'tests/unit/test_make_tiny_hf.py::test_moe_shares_the_tokenizer_data_and_warm_up',  # 8.8
    'tests/unit/test_model_imports.py::test_model_modules_import_one_way',  # 2.9
    'tests/unit/test_plan_moe.py::test_parameters_per_rank_equal_a_megatron_build',  # 2.8
    'tests/unit/test_policy_lag.py::test_training_with_lag_2_sees_a_larger_mismatch',  # 3.6
    'tests/unit/test_readme.py::test_the_analyze_section_commands_run',  # 3.9
    'tests/unit/test_readme.py::test_the_cluster_section_commands_run',  # 5.8
    'tests/unit/test_readme.py::test_the_test_command_fails_when_pytest_collects_nothing',  # 3.7
    'tests/unit/test_recipes.py::test_bad_recipe_under_torchrun_exits_nonzero_on_every_rank',  # 6.2
    'tests/unit/test_trackers.py::test_each_tracker_says_once_where_it_writes',  # 2.9
    'tests/unit/test_vllm_e2e.py::test_the_script_refuses_in_its_own_process_on_this_cpu_machine',  # 2.8
    'tests/unit/test_vllm_engine.py::test_trainer_streams_hf_weights_and_sleeps_between_steps[bf16]',  # 10.5
    'tests/unit/test_vllm_engine.py::test_trainer_streams_hf_weights_and_sleeps_between_steps[fp8]',  # 10.0
]
