"""Cluster environments: which world a process belongs to (torchrun, SLURM, MPI, LSF,
Kubeflow, our own workers), read from a mapping of environment variables."""
