"""fastgrpo.sync"""
