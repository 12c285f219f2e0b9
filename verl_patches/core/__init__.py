"""The registry floor: the patch record (``record``), the registry that checks the records it is handed as one
catalogue (``registry``), applying and undoing them (``apply``), fingerprints of upstream code read from source
(``fingerprint``, ``upstream``), the upstream lock (``lock``) and the source-only components (``sources``), the
process's phase (``phase``), the doctor (``doctor``), the prelude line in verl's worker module (``hook``), the
generated docs/PATCHES.md (``docs``), the recipe's features (``features``) and the attributes stashed on upstream
objects (``stash``). core/ imports no patch module: the catalogue (verl_patches/patches/) hands it the records.
"""
