"""The package version, in one place: the build, `jdp.__version__`, saved files."""

__version__ = "0.4.0.dev0"
