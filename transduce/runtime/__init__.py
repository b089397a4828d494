"""The runtime: backends and decoding. Importing it imports no framework (torch, onnxruntime,
tensorrt); each backend imports its own when it is used."""

from transduce.runtime.api import load
from transduce.runtime.decoding import DecodeResult, DecodingOptions, Hypothesis, decode
from transduce.runtime.translator import Candidate, Translation, Translator

__all__ = ["load", "DecodeResult", "DecodingOptions", "Hypothesis", "decode", "Translator", "Translation", "Candidate"]
