"""The PyTorch backend (torch.distributed); see the README for what has landed."""
