"""fastgrpo.demo"""
