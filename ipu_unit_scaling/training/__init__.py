"""The training machinery under the loop: the run config, data, run directories, the memory
estimate, precision regimes, validation and plots."""
