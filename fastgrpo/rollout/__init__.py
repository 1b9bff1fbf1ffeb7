"""fastgrpo.rollout"""
