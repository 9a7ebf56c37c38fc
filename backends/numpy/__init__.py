"""The numpy backend: the sharded executor on a simulated mesh (every rank in one process), with
its own small autodiff. The executable specification of whole models, forward and backward."""
