"""rtp-serve: disaggregated LLM inference serving (RTP-LLM style).

The one import package of the distribution. Its parts, by folder (setup.py maps them):

    rtp_serve.core       rtp_serve/core/    the torch-free contract every process imports
    rtp_serve.models     rtp_serve/models/  tools that build checkpoints
    rtp_serve.kernels    rtp_serve/kernels/ ops and their dispatch; sources in kernels/
    rtp_serve.engine     engine/            the workers' torch engine
    rtp_serve.services   services/          the services and the `rtp-serve` command
"""

__version__ = "0.1.0"
