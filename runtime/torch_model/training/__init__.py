"""Training the embedded default model (specs/default-model.md): the corpus (austen.py,
rdata.py), differentiable forwards built from the engine's blocks (forward.py), pretraining with the
MTP loss (pretrain.py, its learning-rate schedule in schedule.py), MTP self-distillation (distill.py), the DFlash drafter (dflash.py), the
build (build.py), its figures (evaluate.py) and the command line (cli.py)."""
