"""What a scheduler's environment tells relaunch (Slurm, Kubernetes, MPI), decided."""
