"""What the command line (`python -m flashcupy`) and the benchmarks are built from: `check` runs
the backends against the float64 oracle, `bench` times them side by side with their peers."""
