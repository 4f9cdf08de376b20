"""Where a model's files are read from: `--model-path` as a local folder, or as a Hugging Face model id
("Qwen/Qwen2.5-0.5B-Instruct") found in the local Hugging Face cache, as SGLang users type it.

The cache is huggingface_hub's own (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub), read through its
API with `local_files_only`: radixmesh never downloads, and a model that is neither a folder nor cached is refused
with an error that says where it looked. `--revision` (a branch, tag or commit hash; default main) picks the
snapshot. Every reader of a model's files (the engine's config and weights, the tokenizer in the engine and in the
tokenizer service) resolves the path here, so all of them read the same snapshot.
"""

from __future__ import annotations

import os


def resolve_model_dir(path: str, revision: str | None = None) -> str:
    """`path` when it is a directory (a local folder has no revisions), else the cached snapshot folder of the
    Hugging Face model `path` at `revision`. FileNotFoundError when it is neither, naming where it looked."""
    if os.path.isdir(path):
        return path
    from huggingface_hub import constants, errors, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    incomplete = getattr(errors, "IncompleteSnapshotError", ())  # (huggingface_hub 1.x has none: nothing to catch)
    try:
        return snapshot_download(path, revision=revision, local_files_only=True)
    except HFValidationError:
        raise FileNotFoundError(f"model path {path!r} is not a directory, nor a Hugging Face model id "
                                "(organisation/name)") from None
    except incomplete as e:
        raise FileNotFoundError(f"model path {path!r}: the Hugging Face cache holds an incomplete snapshot of it: "
                                f"{e}; radixmesh does not download: complete it (hf download {path}) first") from None
    except LocalEntryNotFoundError:
        raise FileNotFoundError(f"model path {path!r} is not a directory, and the Hugging Face cache holds no "
                                f"snapshot of model {path!r} at revision {revision or constants.DEFAULT_REVISION} "
                                f"(looked in {_cache_folder(path)}; the cache is HF_HUB_CACHE, else HF_HOME/hub); "
                                f"radixmesh does not download: fetch it first (hf download {path}"
                                f"{f' --revision {revision}' if revision else ''}) or pass a local folder") from None


def _cache_folder(repo_id: str) -> str:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return os.path.join(constants.HF_HUB_CACHE, repo_folder_name(repo_id=repo_id, repo_type="model"))
