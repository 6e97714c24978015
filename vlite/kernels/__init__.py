"""Native CPU kernels, compiled from C on first use (see :mod:`vlite.kernels.native`)."""
