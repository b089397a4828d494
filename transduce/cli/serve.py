"""`transduce serve` (click only; the work is done by transduce.serve.server.serve)."""

from __future__ import annotations

import sys

import click

from transduce.cli.errors import QUIET_HELP, cli_errors, renamed
from transduce.cli.options import backend_options, dataclass_options, renamed_option
from transduce.serve.service import ServiceOptions


@click.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; put auth or a proxy in front).")
@click.option("--port", default=8000, show_default=True, help="TCP port to listen on.")
@click.option("--max-body-bytes", default=1 << 20, show_default=True, help="Request body size, at most (413 past it).")
@click.option("--grace", default=30.0, show_default=True,
              help="Seconds SIGTERM or Ctrl-C lets the requests under way finish before the server exits.")
@click.option("--api-key-file", type=click.Path(), default=None,
              help="A file holding a bearer token: every endpoint but /healthz then needs "
                   "'Authorization: Bearer <token>' (401 otherwise). The key is never logged.")
@click.option("--read-timeout", default=10.0, show_default=True,
              help="Seconds a request's headers, then its body, may take to arrive (408 and the connection closed "
                   "past it: a client that stalls or trickles them holds no connection for long).")
@click.option("--keep-alive", default=5.0, show_default=True,
              help="Seconds an idle connection is kept open between requests.")
@click.option("--languages", default=None,
              help="The model's language pair as SRC:TGT (e.g. en:fr), for LibreTranslate's POST /translate and "
                   "GET /languages; default: what the model's tokenizer names, else any codes are taken.")
@click.option("--ray", "use_ray", is_flag=True, help="Run as a Ray Serve deployment instead (see --replicas).")
@click.option("--replicas", default=1, show_default=True, help="Ray Serve replicas, each with its own backend.")
@click.option("--address", default=None, help="With --ray: the Ray cluster to join (default: a local Ray).")
@click.option("--quiet", is_flag=True, help=QUIET_HELP)
@cli_errors
@backend_options(threads_help="Framework threads (0: its default).")
@dataclass_options(ServiceOptions, "service", renamed={"request_timeout": "--timeout", "default_beam_size": "--beam"})
def serve(artifact_dir, host, port, max_body_bytes, grace, api_key_file, read_timeout, keep_alive, languages, use_ray,
          replicas, address, quiet, spec, service):
    """Serve translations over HTTP: POST /v1/translate, /v1/score, LibreTranslate's POST /translate, GET
    /languages, /v1/models, /healthz, /readyz, /metrics.

    One process owns the backend; one decode thread runs the running batch, which admits each request's
    sentences at the next step boundary where its rows fit and retires them as they finish (a backend that
    cannot admit rows into a running batch, tensorrt, admits only into an empty one). SIGTERM or Ctrl-C
    drain: readyz fails, the requests under way finish (within --grace), then the exit status is 0.
    """
    if use_ray:
        from transduce.serve.ray import run_ray

        sys.exit(run_ray(artifact_dir, spec, host=host, port=port, options=service, replicas=replicas,
                         address=address, quiet=quiet, grace=grace, api_key_file=api_key_file,
                         max_body_bytes=max_body_bytes))
    if address or replicas != 1:
        from transduce.errors import InputError

        raise InputError("--address and --replicas are the Ray deployment's", hint="add --ray, or leave them out")
    from transduce.serve.server import serve as run

    def log(text: str) -> None:
        click.echo(text, err=True)

    sys.exit(run(artifact_dir, spec, host=host, port=port, options=service, api_key_file=api_key_file, grace=grace,
                 max_body_bytes=max_body_bytes, quiet=quiet, log=log, read_timeout=read_timeout,
                 keep_alive=keep_alive, languages=languages))


@click.command()
@click.argument("urls", nargs=-1, required=True)
@click.option("--rates", default="2,5,10,20", show_default=True,
              help="Offered loads, requests per second (Poisson arrivals), comma-separated.")
@click.option("--connections", default=None,
              help="Closed loop instead of --rates: connection counts, comma-separated, each connection sending its "
                   "next request as soon as its last is answered (the load a server sustains).")
@click.option("--duration", default=10.0, show_default=True, help="Seconds of arrivals per load and server.")
@renamed_option("--beam-size", "--beam", "beam_size", default=None, type=int,
                help="Beam size of every request (1 = greedy).  [default: 1]")
@click.option("--data", "data_path", default=None, type=click.Path(),
              help="Sentences to send, one per line (a TSV's first column); default: the demo corpus's held-out "
                   "sources.")
@click.option("--artifact", default=None, type=click.Path(),
              help="Also time offline decoding of the same sentences with this artifact, on this machine.")
@click.option("--api-key-file", type=click.Path(), default=None, help="Bearer token for servers that need one.")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds a request may take (client side).")
@click.option("--seed", default=0, show_default=True, help="Seed of the arrivals and the sentences drawn.")
@click.option("--out", "out_dir", default="runs/loadtest", show_default=True,
              help="Directory for loadtest.json, loadtest.md and loadtest.png.")
@click.option("--force", is_flag=True, help="Replace an earlier report in --out.")
@click.option("--quiet", is_flag=True, help=QUIET_HELP)
@cli_errors
def loadtest(urls, rates, connections, duration, beam_size, deprecated_beam_size, data_path, artifact, api_key_file,
             timeout, seed, out_dir, force, quiet):
    """Open-loop load on running servers (URLs of `transduce serve`; several: interleaved, one window per rate
    and server in turn), or closed-loop with --connections: throughput, latency and time-to-first-token
    percentiles, rejections and timeouts.

    Compare schedulers by serving the same artifact three times (--scheduler continuous, static, single) and
    passing the three URLs. Writes loadtest.json, loadtest.md and loadtest.png (p99 latency against load).
    """
    import math
    import os

    from transduce.errors import InputError
    from transduce.serve.loadtest import offline_throughput, run_loadtest, sentences_from, write_report
    from transduce.serve.server import read_api_key

    beam = renamed(beam_size, deprecated_beam_size, "--beam-size", "--beam")
    beam = 1 if beam is None else beam
    try:
        offered = [float(r) for r in rates.split(",") if r.strip()]
    except ValueError:
        raise InputError(f"--rates must be numbers separated by commas, got {rates!r}") from None
    if not offered or not all(0 < r < math.inf for r in offered):
        raise InputError(f"--rates must be finite numbers > 0 (requests per second), got {rates!r}")
    if not 0 < duration < math.inf:
        raise InputError(f"--duration must be a finite number of seconds > 0, got {duration!r}")
    conns = None
    if connections is not None:
        try:
            conns = [int(n) for n in connections.split(",") if n.strip()]
        except ValueError:
            raise InputError(f"--connections must be whole numbers separated by commas, got {connections!r}") from None
        if not conns or min(conns) < 1:
            raise InputError(f"--connections must be at least 1 each, got {connections!r}")
    if os.path.exists(os.path.join(out_dir, "loadtest.json")) and not force:
        raise InputError(f"{out_dir} already holds a load-test report (loadtest.json)",
                         hint="pass --force to replace it")

    def log(text: str) -> None:
        if not quiet:
            click.echo(text, err=True)

    sentences = sentences_from(data_path)
    key = read_api_key(api_key_file) if api_key_file else None
    report = run_loadtest(list(urls), offered, duration, sentences, {"beam_size": beam}, key, seed, timeout, log,
                          connections=conns)
    if artifact:
        report["offline"] = offline_throughput(artifact, sentences, beam)
        log(f"offline decode: {report['offline']['throughput']:.1f} sentences/s")
    for path in write_report(report, out_dir):
        log(f"wrote {path}")


COMMANDS = [serve, loadtest]
