"""Ordinary English words that prompt text is assembled from.

Most byte-level BPE vocabularies hold each of these, with a leading space, as one token, which
is what lets a prompt be built to an exact token count; words that a given tokenizer splits are
filtered out at run time (`PromptSynthesizer`).
"""

_WORDS = """
    about above across after again against along already also always among animal answer
    area around asked away back ball base beautiful became because become been before began
    behind being below best better between big bird black blue boat body book both bottom
    box boy bring brought build built business call came can car care carry case cat cause
    center certain change check child children city class clear close cold color come common
    complete could country course cover cross cut dark day decided deep develop did differ
    different direction does dog done door down draw during each early earth east easy eat
    end enough even ever every example eye face fact fall family far farm fast father feel
    feet felt few field figure fill final find fine fire first fish five floor fly follow food
    foot force form found four free friend from front full game gave general get girl give
    given going gold good got government great green ground group grow half hand happen happy
    hard have head hear heard heart heat heavy help here high hold home horse hot hour house
    however idea important inch include inside interest island just keep kind king knew know
    land language large last late later laugh lay lead learn leave left less letter level life
    light like line list listen little live long look lost love low machine made main make man
    many map mark matter may mean measure men might mile mind minute miss money moon more
    morning most mother mountain move much music must name near need never new next night
    north note nothing notice number object often old once only open order other our out over
    own page paper part pass past people perhaps person picture piece place plan plant play
    point power present problem produce product pull put question quick quite rain ran reach
    read ready real reason record red remember rest river road rock room round rule run said
    same saw say school science sea second see seem self sentence serve set several shape
    short should show side simple since sing size sleep slow small snow some song soon sound
    south space special spell stand star start state stay step still stood stop story street
    strong study such summer sun sure surface system table take talk teach team tell ten test
    than that their them then there these thing think third this those though thought three
    through time today together told too took top toward town travel tree true try turn two
    under unit until upon usual very voice vowel wait walk wall want warm watch water way
    weather week weight well went were west what wheel when where which while white whole why
    wide will wind window winter wish with without woman wonder wood word work world would
    write year yellow young
"""

COMMON_WORDS: tuple[str, ...] = tuple(_WORDS.split())
