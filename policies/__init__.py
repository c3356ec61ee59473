"""Recovery policies: decide what to do about a fault; never act."""
