"""k3fuse: compiler passes for Kimi K3 decode."""
