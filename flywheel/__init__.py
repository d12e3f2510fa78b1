"""flywheel: an open data flywheel for AI agents."""
__version__ = "0.1.0"
