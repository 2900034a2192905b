"""digits-cnn: a small CNN on scikit-learn's 8x8 digits, trained by a plain torchrun script with its own loop."""
