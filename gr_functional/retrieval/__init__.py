"""The retrieval task (``model.task = "retrieval"``): GR's research HSTU (gr_functional/model.py,
losses.py) on leave-one-out sequences, evaluated by full-catalogue HR@K / NDCG@K / MRR
(``task.RetrievalTask``)."""
