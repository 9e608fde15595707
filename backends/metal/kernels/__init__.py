"""CUDA and Metal kernels of the native backend, one file per kernel family, each checked once
against MLX's own operations before a model uses it."""
