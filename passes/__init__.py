"""Graph rewrite passes (installed as snapcompile.passes)."""
import onnx_graphsurgeon as gs

gs.logger.G_LOGGER.severity = gs.logger.G_LOGGER.ERROR  # its warnings are not actionable by users
