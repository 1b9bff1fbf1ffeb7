"""fastgrpo.rewards"""
