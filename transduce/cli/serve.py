"""`transduce serve` (click only; the work is done by transduce.serve.server.serve)."""

from __future__ import annotations

import sys

import click

from transduce.cli.errors import QUIET_HELP, cli_errors, renamed, warn
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
@click.option("--engine", type=click.Choice(["thread", "process"]), default=None,
              help="Where the backend and decode loop run: a process of their own that the HTTP side's work never "
                   "holds up (the default), or a thread of the server (see docs/serving.md). [default: process; "
                   "with --ray, each replica's thread]")
@click.option("--engines", default=0, show_default=True,
              help="Engine processes (--engine process), each loading the model with a running batch of its own; "
                   "a request goes to the first with fewer rows under way than --fill-rows, else to the one with "
                   "the fewest. 0: two on a CPU of two cores or more (a core one decode thread cannot use), one on "
                   "a GPU; 1 halves the memory. Without --threads, an ONNX Runtime engine decodes on every core "
                   "while it alone has work, on its share while another one has too.")
@click.option("--ray", "use_ray", is_flag=True, help="Run as a Ray Serve deployment instead (see --replicas).")
@click.option("--replicas", default=1, show_default=True, help="Ray Serve replicas, each with its own backend.")
@click.option("--address", default=None, help="With --ray: the Ray cluster to join (default: a local Ray).")
@click.option("--quiet", is_flag=True, help=QUIET_HELP)
@cli_errors
@backend_options(threads_help="Framework threads (0: its default).")
@dataclass_options(ServiceOptions, "service", renamed={"request_timeout": "--timeout", "default_beam_size": "--beam"})
def serve(artifact_dir, host, port, max_body_bytes, grace, api_key_file, read_timeout, keep_alive, languages, engine,
          engines, use_ray, replicas, address, quiet, spec, service):
    """Serve translations over HTTP: POST /v1/translate, /v1/score, LibreTranslate's POST /translate, GET
    /languages, /v1/models, /healthz, /readyz, /metrics.

    An engine process (--engines N: N of them) owns the backend; its decode thread runs the running batch,
    which admits each request's sentences at a step boundary where its rows fit and retires them as they finish
    (a backend that cannot admit rows into a running batch, tensorrt, admits only into an empty one); the
    server's own process does HTTP, tokenizing and detokenizing (--engine thread: all in one process). SIGTERM
    or Ctrl-C drain: readyz fails, the requests under way finish (within --grace), then the exit status is 0.
    """
    if use_ray and (engine == "process" or engines > 1):
        from transduce.errors import InputError

        raise InputError("--engine process is the single server's: each Ray replica runs its decode thread",
                         hint="leave out --engine, or --ray")
    if use_ray and keep_alive != 5.0:
        from transduce.errors import InputError

        raise InputError("--keep-alive is the single server's: Ray's HTTP proxy keeps the connections",
                         hint="leave out --keep-alive, or --ray")
    if use_ray:
        from transduce.serve.libre import Languages
        from transduce.serve.ray import run_ray
        from transduce.serve.server import check_listening

        check_listening(host, port, grace, max_body_bytes, read_timeout)  # refused before Ray starts
        if languages is not None:
            Languages.parse(languages)
        sys.exit(run_ray(artifact_dir, spec, host=host, port=port, options=service, replicas=replicas,
                         address=address, quiet=quiet, grace=grace, api_key_file=api_key_file,
                         max_body_bytes=max_body_bytes, read_timeout=read_timeout, languages=languages))
    if address or replicas != 1:
        from transduce.errors import InputError

        raise InputError("--address and --replicas are the Ray deployment's", hint="add --ray, or leave them out")
    from transduce.serve.server import serve as run

    def log(text: str) -> None:
        click.echo(text, err=True)

    sys.exit(run(artifact_dir, spec, host=host, port=port, options=service, api_key_file=api_key_file, grace=grace,
                 max_body_bytes=max_body_bytes, quiet=quiet, log=log, read_timeout=read_timeout,
                 keep_alive=keep_alive, languages=languages, engine=engine or "process", engines=engines))


@click.command()
@click.argument("urls", nargs=-1, required=True)
@click.option("--rates", default="2,5,10,20", show_default=True,
              help="Offered loads, requests per second (Poisson arrivals), comma-separated.")
@click.option("--connections", default=None,
              help="Closed loop instead of --rates: connection counts, comma-separated, each connection sending its "
                   "next request as soon as its last is answered (the load a server sustains).")
@click.option("--processes", default=None, type=int,
              help="Closed loop: generator processes the connections are spread over.  [default: min(2, cores)]")
@click.option("--warmup", default=2.0, show_default=True,
              help="Closed loop: seconds of load before each measured window, not counted.")
@click.option("--duration", default=10.0, show_default=True, help="Seconds measured per load and server.")
@click.option("--sentences-per-request", default=1, show_default=True, help="Sentences in each request.")
@renamed_option("--beam-size", "--beam", "beam_size", default=None, type=int,
                help="Beam size of every request (1 = greedy).  [default: 1]")
@click.option("--data", "data_path", default=None, type=click.Path(),
              help="Sentences to send, one per line (a TSV's first column); default: the demo corpus's held-out "
                   "sources.")
@click.option("--artifact", default=None, type=click.Path(),
              help="Also time offline decoding of the same sentences with this artifact, on this machine (in a "
                   "process of its own), and give each load's ratio to it.")
@click.option("--api-key-file", type=click.Path(), default=None, help="Bearer token for servers that need one.")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds a request may take (client side).")
@click.option("--seed", default=0, show_default=True, help="Seed of the arrivals and the sentences drawn.")
@click.option("--out", "out_dir", default="runs/loadtest", show_default=True,
              help="Directory for loadtest.json, loadtest.md and loadtest.png.")
@click.option("--force", is_flag=True, help="Replace an earlier report in --out.")
@click.option("--quiet", is_flag=True, help=QUIET_HELP)
@cli_errors
def loadtest(urls, rates, connections, processes, warmup, duration, sentences_per_request, beam_size,
             deprecated_beam_size, data_path, artifact, api_key_file, timeout, seed, out_dir, force, quiet):
    """Open-loop load on running servers (URLs of `transduce serve`; several: interleaved, one window per rate
    and server in turn), or closed-loop with --connections (keep-alive connections spread over --processes
    generator processes): requests and sentences per second, latency percentiles, errors by status, the
    server's CPU seconds per request and per sentence.

    Compare schedulers by serving the same artifact three times (--scheduler continuous, static, single) and
    passing the three URLs. Writes loadtest.json, loadtest.md and loadtest.png (p99 latency against load).
    """
    import os

    from transduce.errors import InputError
    from transduce.serve import loadtest as lt
    from transduce.serve.loadcost import offline_figures
    from transduce.serve.server import read_api_key

    beam = renamed(beam_size, deprecated_beam_size, "--beam-size", "--beam")
    conns = () if connections is None else _numbers(connections, int, "--connections", "whole numbers")
    plan = lt.LoadPlan(rates=_numbers(rates, float, "--rates", "numbers"), connections=conns, duration=duration,
                       warmup=warmup, processes=lt.default_processes() if processes is None else processes,
                       sentences_per_request=sentences_per_request, beam_size=1 if beam is None else beam,
                       timeout=timeout, seed=seed)
    if artifact and not os.path.isdir(artifact):  # found out now, not after the load
        raise InputError(f"--artifact {artifact!r} is not a directory", hint="give an exported artifact directory")
    if os.path.exists(os.path.join(out_dir, "loadtest.json")) and not force:
        raise InputError(f"{out_dir} already holds a load-test report (loadtest.json)",
                         hint="pass --force to replace it")

    def log(text: str) -> None:
        if not quiet:
            click.echo(text, err=True)

    sentences = lt.sentences_from(data_path)
    key = read_api_key(api_key_file) if api_key_file else None
    report = lt.run_loadtest(list(urls), sentences, plan, key, log)
    if artifact:
        offline = offline_figures(artifact, sentences, plan.beam_size, plan.sentences_per_request)
        lt.compare_offline(report, offline)
        log(f"offline decode: {offline['throughput']:.1f} sentences/s, one request at a time p50 "
            f"{offline['request_latency_p50'] * 1000:.1f} ms")
    for path in lt.write_report(report, out_dir):
        log(f"wrote {path}")
    for text in lt.short_warmups(report):
        warn(text)


def _numbers(text: str, kind: type, flag: str, what: str) -> tuple:
    """A comma-separated list of numbers, or an InputError naming `flag`."""
    from transduce.errors import InputError

    try:
        out = tuple(kind(n) for n in text.split(",") if n.strip())
    except ValueError:
        raise InputError(f"{flag} must be {what} separated by commas, got {text!r}") from None
    if not out:
        raise InputError(f"{flag} must be {what} separated by commas, got {text!r}")
    return out


COMMANDS = [serve, loadtest]
