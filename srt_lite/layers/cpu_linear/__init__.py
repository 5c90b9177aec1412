"""How a linear layer computes on a CPU: the path chosen for a model (paths.py), the products
and weight layouts (products.py), GGUF weights in their quantized blocks (gguf.py), and the
layer that holds a weight's copies and picks one per step (packable.py)."""
