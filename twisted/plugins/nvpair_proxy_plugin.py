"""``twistd nvpair-proxy``: the dropin. Imports stay lazy so ``twistd --help`` stays fast."""

from twisted.application.service import ServiceMaker

nvpairProxy = ServiceMaker(
    "nvpair-proxy",
    "nvpair_proxy.process.tap",
    "Inference data plane for GPU clusters running local LLM engines.",
    "nvpair-proxy",
)
