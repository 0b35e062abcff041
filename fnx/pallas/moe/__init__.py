"""Fused MoE decode kernels: top-k routing and a weight-major (one read per distinct expert) expert pipeline."""
