"""heads: everything trainable in selfspec (draft heads, exit heads), their training and checkpoints."""
