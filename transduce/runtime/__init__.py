"""The runtime: which backend decodes (spec.BackendSpec, backends/registry.py), the backends (backends/), the
decoding engine (decoding/) and the Translator; load() is the entry point (api.py). Importing it imports no
framework (torch, onnxruntime, tensorrt); each backend imports its own when it is opened."""

from transduce.runtime.api import load
from transduce.runtime.decoding import DecodeResult, DecodingOptions, Hypothesis, decode
from transduce.runtime.translator import Candidate, Translation, Translator

__all__ = ["load", "DecodeResult", "DecodingOptions", "Hypothesis", "decode", "Translator", "Translation", "Candidate"]
