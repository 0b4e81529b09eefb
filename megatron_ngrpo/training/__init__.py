"""The application on top: the job config that composes every package's section, the N-GRPO
trainer that runs it (rollout → reward → advantage → replay → loss → step → weight sync), its
supervised warm-start and its resumable run checkpoints."""
