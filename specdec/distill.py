"""``python -m specdec.distill`` (and ``torchrun --nproc_per_node N -m specdec.distill``): see specdec.training.distill."""

from specdec.training.distill import main

if __name__ == "__main__":
    main()
