"""The run skeleton every recipe shares: the run folder, configurations,
checkpoints, the step log, the process group and AdamW."""
