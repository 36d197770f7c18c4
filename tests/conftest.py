"""Test setup: no network, a shared cache for the embedded tiny model, the repository root on sys.path."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["HF_HUB_OFFLINE"] = "1"  # the tests never touch the network
os.environ.setdefault("STARPO_CACHE", str(ROOT / ".cache" / "tiny"))  # built once, reused by every test and subprocess


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a learning run (minutes); still part of the CI suite")
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped elsewhere")
