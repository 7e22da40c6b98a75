"""Training-side access to a job's hidden states: a PyTorch Dataset and the layer conventions."""
