"""The pipeline: the dataset (a source), MemGAS's branch, JustMem's branch, the answers' judge and the
evaluation (a report). Each step declares the tables it reads and writes (:mod:`memgas.jobs.stage`,
:mod:`memgas.jobs.tables`); the runner derives the data flow from them, so a new stage is one module here
and one entry below. ``memgas index`` runs the steps ``INDEX``, ``memgas answer`` the steps ``ANSWER``
(:func:`memgas.jobs.stage.command_slices`: by where a stage's tables live)."""

from __future__ import annotations

from memgas.jobs.stage import command_slices
from memgas.jobs.stages.associate import AssociateStage
from memgas.jobs.stages.card_graph import CardGraphEncodeStage
from memgas.jobs.stages.card_graph_associate import CardGraphAssociateStage
from memgas.jobs.stages.card_graph_rank import CardGraphRankStage
from memgas.jobs.stages.card_graph_read import CardGraphReadStage
from memgas.jobs.stages.cards import CardsStage
from memgas.jobs.stages.encode import EncodeStage
from memgas.jobs.stages.evaluate import EvaluateReport
from memgas.jobs.stages.generate import GenerateStage
from memgas.jobs.stages.ingest import IngestSource
from memgas.jobs.stages.judge import JudgeStage
from memgas.jobs.stages.justmem import CardEncodeStage, CardRankStage, CardReadStage
from memgas.jobs.stages.nodes import NodesStage
from memgas.jobs.stages.plan import PlanStage
from memgas.jobs.stages.rank import RankStage
from memgas.jobs.stages.read import ReadStage

__all__ = ["ANSWER", "INDEX", "PIPELINE"]

# encode, card-encode and card-graph-encode are adjacent: the JustMem and card-graph encoders reuse MemGAS's
# encoder actors. The card-graph stages (memgas-cards) exist only when it is selected.
PIPELINE = (IngestSource(), GenerateStage(), CardsStage(), PlanStage(), NodesStage(), EncodeStage(),
            CardEncodeStage(), CardGraphEncodeStage(), AssociateStage(), CardGraphAssociateStage(), RankStage(),
            CardRankStage(), CardGraphRankStage(), ReadStage(), CardReadStage(), CardGraphReadStage(), JudgeStage(),
            EvaluateReport())
INDEX, ANSWER = command_slices(PIPELINE)
