"""A game with a multi-turn environment: a LangGraph agent plays tic-tac-toe against a scripted opponent."""
