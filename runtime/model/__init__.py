"""The user's model: the model-file contract, splitting one nn.Module into stages, partition files."""
