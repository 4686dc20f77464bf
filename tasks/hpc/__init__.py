"""HPC jobs: MPI launch lines and (to come) the molecular-dynamics kernel."""
