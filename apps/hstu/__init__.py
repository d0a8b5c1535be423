"""The generative recommender (HSTU, Zhai et al., ICML 2024): its model, sequence data and metrics."""
