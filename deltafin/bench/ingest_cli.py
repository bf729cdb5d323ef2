"""``deltafin bench ingest``'s arguments, apart from the benchmark (building the parser imports no torch)."""

from __future__ import annotations

K3_MOE_LAYERS = 92  # Kimi K3: 93 layers, the first dense
K3_TOPK = 16


def add_args(sub) -> None:
    b = sub.add_parser("ingest", help="the expert ingestion path stage by stage (reads, checksums, host->device, "
                                      "math), each beside its limit, and GB/s delivered against the rate offered")
    b.add_argument("--dir", default=None, help="scratch folder (on the drive to measure, or /dev/shm for memory)")
    b.add_argument("--layers", type=int, default=4, help="MoE layers of the synthetic model")
    b.add_argument("--experts", type=int, default=64, help="experts per layer")
    b.add_argument("--k", type=int, default=K3_TOPK, help="experts routed per token per layer")
    b.add_argument("--tokens", type=int, default=6, help="tokens decoded per measurement")
    b.add_argument("--threads", default="8,32", help="reads in flight to measure, comma-separated")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    b.add_argument("--offered", default="", help="offered rates in GB/s for the curve, e.g. 2,5,10,25,50")
    b.add_argument("--drives", default="", help="emulated drive set for a decode at the drives' rates, "
                                                "e.g. report4 (7 + 3 x 6 GB/s)")
    b.add_argument("--k3-shape", action="store_true",
                   help="with --drives: Kimi K3's shape, 92 MoE layers x 16 experts a token (writes ~32 GB)")
    b.add_argument("--guess", type=float, default=None, metavar="RIGHT",
                   help="also decode with each next layer's reads started a layer early on a guess of its routing, "
                        "this share of its experts right (0-1; 1: routes known ahead), as --guess-next does")
    b.add_argument("--plot", metavar="PNG", help="draw the offered/delivered curve")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", metavar="PATH")
