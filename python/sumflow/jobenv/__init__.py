"""The job as other launchers describe it to a process: torchrun, horovodrun, Open MPI's
mpirun, MPICH's mpiexec and Slurm's srun (docs/launcher.md, "Other launchers").

:mod:`~sumflow.jobenv.launchers` reads each launcher's environment into one
:class:`~sumflow.jobenv.environment.LaunchEnvironment` (pure functions, and ``detect``,
which picks the launcher); :mod:`~sumflow.jobenv.coordinator` decides where the job's
coordinator is and who starts it; :mod:`~sumflow.jobenv.rendezvous` is the file through
which rank 0 tells the others on one machine; :mod:`~sumflow.jobenv.elastic` is how a
worker of an elastic ``sumflow-run`` job takes its place in each membership epoch;
:mod:`~sumflow.jobenv.hostlist` expands Slurm's compressed host lists, which
``sumflow-run`` reads too. The torch runtime
(``sumflow.torch._runtime``) starts what these decide.
"""
