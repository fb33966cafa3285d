"""Pure-PyTorch transformer encoders: config, model, TorchScript bundles (export, verify, load), converters.

Imports nothing at package level, so `model.config` stays importable without loading torch.
"""
