"""``python -m specdec.train`` (and ``torchrun --nproc_per_node N -m specdec.train``): see specdec.training.train."""

from specdec.training.train import main

if __name__ == "__main__":
    main()
