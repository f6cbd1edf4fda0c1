"""Offline training of the models that reward_service serves.

Nothing here is imported by the running services. Modules:

* ``connect4_encoding`` — move strings -> uint8 board planes ``[2, 6, 7]``
  (the same observation the search service sends to the value model);
* ``connect4_data`` — the shipped solver-labelled positions as arrays, and the
  seeded train / held-out split;
* ``connect4_model`` — the small residual CNN (PyTorch);
* ``train_connect4_value`` — train, export to ONNX, verify, evaluate, write the
  model card (``python -m training.train_connect4_value``).

Training needs the ``train`` extra (torch, onnx); encoding and data loading
need only NumPy.
"""
