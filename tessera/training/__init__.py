"""The training loop and what it composes: optimizer, schedules, precision, metrics."""
