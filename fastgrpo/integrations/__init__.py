"""fastgrpo.integrations"""
