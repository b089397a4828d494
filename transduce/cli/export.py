"""The exporter's subcommands (click only; the work is done by transduce.exporter.onnx_export)."""

from __future__ import annotations

import click

from transduce.cli.errors import QUIET_HELP, cli_errors, log_lines, renamed
from transduce.exporter.onnx_export import DEFAULT_OPSET, MAX_OPSET, MIN_OPSET  # no framework imported
from transduce.formats.artifact import PRECISIONS
from transduce.formats.artifact import QUANTIZATION_METHODS as QUANTIZE_METHODS

# the library's parameters that export names otherwise than by their own name (see cli_errors.command_names)
EXPORT_NAMES = {"ort_step_graph=False": "--no-ort-step"}


class _DeprecatedArgument(click.Argument):
    """An argument that still works but is left out of the usage line."""

    def get_usage_pieces(self, ctx):
        return []


@click.command("export")
@click.argument("model_dir", type=click.Path())
@click.argument("old_out_dir", cls=_DeprecatedArgument, metavar="OUT_DIR", required=False, type=click.Path())
@click.option("--out", "out_dir", metavar="OUT_DIR", type=click.Path(),
              help="Artifact directory to write. (OUT_DIR as a second argument still works, with a warning, "
                   "for one release.)")
@click.option("--force", is_flag=True, help="Replace --out if it is an existing artifact.")
@click.option("--opset", default=DEFAULT_OPSET, show_default=True, type=int,
              help=f"ONNX opset ({MIN_OPSET}..{MAX_OPSET}).")
@click.option("--precision", default="fp32", show_default=True, type=click.Choice(PRECISIONS),
              help="Float precision of the graphs (fp16/bf16 keep LayerNorm, softmax and log_probs in fp32).")
@click.option("--quantize", type=click.Choice(QUANTIZE_METHODS), default=None,
              help="Also quantize encoder.onnx and decoder_step.ort.onnx (int8 weights, ONNX Runtime dynamic "
                   "quantization; ONNX Runtime CPU only).")
@click.option("--no-ort-step", "no_ort_step", is_flag=True,
              help="Leave out decoder_step.ort.onnx, the ONNX Runtime CPU step graph (a second copy of the decoder's "
                   "weights): for TensorRT or CUDA deployment; ONNX Runtime on CPU then decodes with "
                   "decoder_step.onnx, more slowly. Not with --quantize.")
@click.option("--quiet", is_flag=True, help=QUIET_HELP)
@cli_errors(names=EXPORT_NAMES)
def export(model_dir, old_out_dir, out_dir, force, opset, precision, quantize, no_ort_step, quiet):
    """Export MODEL_DIR to an ONNX artifact in --out: encoder.onnx, decoder_step.onnx, manifest.json,
    and for fp32 post-norm models (head size a multiple of 8) decoder_step.ort.onnx (the same step with
    ONNX Runtime's fused ops) unless --no-ort-step.

    encoder.onnx and decoder_step.onnx are checked (ONNX checker, IO contract, TensorRT operator support),
    decoder_step.ort.onnx against its IO contract; all are validated against eager PyTorch; if anything
    fails nothing is written.
    """
    from transduce.exporter.onnx_export import export_artifact

    out_dir = renamed(out_dir, old_out_dir, "--out", "OUT_DIR as an argument")
    if out_dir is None:
        raise click.UsageError("Missing option '--out'.")
    manifest = export_artifact(model_dir, out_dir, force=force, opset=opset, precision=precision,
                               log=log_lines(quiet, "export"), quantize=quantize, ort_step_graph=not no_ort_step)
    click.echo(summary(out_dir, manifest))


def _output_group(name: str) -> str:
    """memory and log_probs as they are; per-layer (and top-k) outputs as one group: cross_key_* ..."""
    return name if name in ("memory", "log_probs") else name.rsplit("_", 1)[0] + "_*"


def summary(out_dir: str, manifest: dict) -> str:
    """A few lines: files and sizes, the validation's worst errors, the time taken."""
    quant = manifest.get("quantization")
    lines = [f"artifact {out_dir} ({manifest['precision']}{', ' + quant['method'] + ' weights' if quant else ''}, "
             f"opset {manifest['opset']}, IO contract v{manifest['contract_version']})"]
    width = max(map(len, manifest["files"]), default=0)
    for name, meta in manifest["files"].items():
        lines.append(f"  {name:<{width}} {meta['bytes']:>12,} bytes")
    val = manifest["validation"]
    worst: dict[str, dict] = {}
    for row in val["errors"]:
        key = _output_group(row["output"])
        if key not in worst or row["max_abs"] > worst[key]["max_abs"]:
            worst[key] = row
    lines.append(f"validated on {val['engine']} against {val['reference']}:")
    width = max(map(len, worst), default=0)
    for key, row in worst.items():
        lines.append(f"  {key:<{width}} max abs {row['max_abs']:.2e}  "
                     f"(tolerance {row['atol']:g} + {row['rtol']:g}*|ref|)")
    if quant:
        rms: dict[str, float] = {}
        for row in quant["validation"]["errors"]:
            if row["graph"] + ".onnx" in quant["graphs"]:
                key = _output_group(row["output"])
                rms[key] = max(rms.get(key, 0.0), row["rel_rms"])
        lines.append(f"{quant['method']} graphs ({', '.join(quant['graphs'])}), relative RMS error against eager:")
        width = max(map(len, rms), default=0)
        lines += [f"  {key:<{width}} {v:.3f}" for key, v in rms.items()]
    lines.append(f"exported in {manifest['export_seconds']['total']:.1f} s")
    return "\n".join(lines)


COMMANDS = [export]
